"""The reference model of vLLM 0.33.0's PCP layout, block tables and draft inputs."""
