"""pcpviz.engine: the tiny DeepSeek-V3 (MLA + MTP) model and the PCP + MTP engine around it.

Kept light on purpose: importing the package imports nothing heavy; submodules
(``pcpviz.engine.model``, ``.model_config``, ``.checkpoint``, ``.tokenizer``, ``.corpus``,
``.train``, ...) are imported on demand.
"""

_LAZY = {
    "TinyDSV3": "model",
    "TinyDSV3Config": "model_config",
    "load_model": "checkpoint",
    "causal_attention": "model",
    "default_model_dir": "model_config",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
