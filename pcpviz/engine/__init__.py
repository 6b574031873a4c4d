"""pcpviz.engine: the tiny DeepSeek-V3 (MLA + MTP) model, its MoE + DSA sibling
(``model_v32``: DeepSeek-V3.2 / GLM-5 shaped) and the PCP + MTP engine around them.

Kept light on purpose: importing the package imports nothing heavy; submodules
(``pcpviz.engine.model``, ``.model_config``, ``.checkpoint``, ``.tokenizer``, ``.corpus``,
``.train``, ...) are imported on demand.
"""

_LAZY = {
    "TinyDSV3": "model",
    "TinyDSV32": "model_v32",
    "build_model": "model_v32",
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
