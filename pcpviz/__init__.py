"""pcpviz: a workbench for vLLM 0.33.0's Prefill Context Parallel + MTP speculative decoding.

    import pcpviz
    res = pcpviz.run(["def fib(n):"], pcp=2, num_speculative_tokens=2, trace_dir="runs/demo")
    trace = pcpviz.trace.open("runs/demo")

See README.md.
"""

from pcpviz.version import __version__

__all__ = ["__version__", "run", "RunResult", "RankError", "trace"]


def __getattr__(name):
    # Lazy: `import pcpviz` stays cheap (no torch) for the CLI and the trace reader.
    if name in ("run", "RunResult", "RankError"):
        from pcpviz.engine import launch

        return getattr(launch, name)
    if name == "trace":
        import importlib

        return importlib.import_module("pcpviz.trace")
    raise AttributeError(f"module 'pcpviz' has no attribute {name!r}")
