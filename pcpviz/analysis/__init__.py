"""Analysis of recorded traces: checks, diff, explain, acceptance, mirror, parity."""
