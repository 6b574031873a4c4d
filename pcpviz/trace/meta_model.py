"""run.json as one typed value: ``RunMeta``, decoded once by the reader (``Trace.run_meta``).

Each known key of run.json is a field of ``RunMeta``, declared once with its type, its default
(what a run.json that does not record it means), its structure check (``meta_checks``) and its
meaning; ``META_SCHEMA`` (key -> (check, required, meaning)) is derived from those fields, so the
validator, the docs (``pcpviz.teaching.docgen``) and the decoder read the same declaration.

Decoding checks structure only: a key whose value is malformed (``"pcp": "2"``) keeps its field's
default and is reported as one ``(key, why)`` pair, which ``pcpviz.trace.validate`` turns into its
one-line INVALID problem (the CLI exits 2); a wrong but well-formed value (``"pcp": 1`` for a
trace with two rank files) decodes and fails ``validate``'s check against the data. Keys pcpviz
does not know stay readable, as JSON, in ``RunMeta.extra`` (forward compatibility: a producer's
own keys, a newer pcpviz's keys); ``recorded`` names the known keys the file holds.

The shipped PCP=2, K=2 CPU trace decodes to ``RunMeta(producer='pcpviz-engine', pcp=2, ...,
num_speculative_tokens=2, block_size=16, ...)``; ``meta.dcp`` is 1 although that run.json does
not record ``dcp`` (``"dcp" in meta.recorded`` is False, ``meta.recorded_value("dcp")`` None).
Every key pcpviz's producers write is a field (tests/trace/test_meta_model.py and
tests/vllm/test_run_meta_producers.py hold them to it), so ``extra`` is empty for their traces; a
key of one's own, ``"rack": "r7"``, is ``meta.extra["rack"]`` (and ``meta.recorded_value("rack")``).

Producers encode from the same type: ``RunMeta.build(producer=..., pcp=2, ...)`` takes each key as a
keyword (another name is a TypeError, a malformed value a ValueError naming the key, where the
producer writes it), and the writers take the value (``write_run_meta``, ``TraceWriter(meta=)``,
the flight ring). The engine (``engine/trace_dir.trace_meta``), the synthetic generator
(``SyntheticRun.meta``) and the vLLM plugin's recorders (``RankRecorder.run_meta``, which the CPU
replay's session feeds) build theirs so.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from pcpviz.limits import MAX_BLOCK_SIZE, MAX_COUNT, MAX_SPECULATIVE_TOKENS, MAX_WORLD_SIZE

from . import meta_checks as C
from .schema import SCHEMA_VERSION

__all__ = ["RunMeta", "LaunchMeta", "META_SCHEMA", "decode_meta", "meta_document", "frozen_json", "thawed_json"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def frozen_json(value: Any) -> Any:
    """A JSON value made immutable: objects as read-only mappings, arrays as tuples.
    ``frozen_json({"a": [1, 2]})`` is ``mappingproxy({'a': (1, 2)})``."""
    if isinstance(value, dict):
        return MappingProxyType({k: frozen_json(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(frozen_json(v) for v in value)
    return value


def thawed_json(value: Any) -> Any:
    """``frozen_json``'s inverse: the plain JSON value (dicts and lists)."""
    if isinstance(value, Mapping):
        return {k: thawed_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thawed_json(v) for v in value]
    return value


@dataclass(frozen=True)
class LaunchMeta:
    """run.json's ``launch`` (the vLLM plugin's launcher): the ``vllm.LLM`` keywords, the sampling
    parameters and the environment, each a read-only JSON object, and the rest in ``extra``.
    ``LaunchMeta.decode({"sampling": {"max_tokens": 48}}).sampling["max_tokens"]`` is 48."""

    llm_kwargs: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    sampling: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    env: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # seconds, ...
    keys: tuple[str, ...] = ()  # the object's keys as recorded, in order (to_json gives them back)

    @classmethod
    def decode(cls, doc: Mapping[str, Any]) -> "LaunchMeta":
        known = ("llm_kwargs", "sampling", "env")
        return cls(**{k: frozen_json(doc[k]) for k in known if k in doc},
                   extra=frozen_json({k: v for k, v in doc.items() if k not in known}), keys=tuple(doc))

    def to_json(self) -> dict[str, Any]:
        """The JSON object back, as recorded."""
        return {k: thawed_json(self.extra[k] if k in self.extra else getattr(self, k)) for k in self.keys}


def _key(check: C.Check, meaning: str, *, default: Any = None, required: bool = False,
         decode: Callable[[Any], Any] = frozen_json) -> Any:
    """A field of RunMeta that is a run.json key: its check, whether required, its meaning, and
    how its JSON value becomes the field's value."""
    return field(default=default, metadata={"check": check, "required": required, "meaning": meaning,
                                            "decode": decode})


@dataclass(frozen=True)
class RunMeta:
    """A trace's run.json, decoded (see the module doc). Field = key; the defaults say what an
    unrecorded key means (``dcp`` 1: no DCP; ``num_speculative_tokens`` None: not known)."""

    producer: str = _key(C.is_str, "what wrote the trace (pcpviz-engine, pcpviz-synthetic, vllm-replay, "
                         "vllm-plugin)", default="", required=True)
    pcp: int | None = _key(C.int_in(1, MAX_WORLD_SIZE), "PCP world size: one rank file per PCP rank",
                           required=True)
    dcp: int = _key(C.int_in(1, MAX_WORLD_SIZE), "DCP world size", default=1)
    dcp_rank: int = _key(C.int_in(0, MAX_WORLD_SIZE - 1), "DCP rank of the recorded ranks", default=0)
    dcp_interleave: int = _key(C.int_in(1, MAX_BLOCK_SIZE), "DCP KV interleave size", default=1)
    dcp_group: str = _key(C.is_str, "'pcp': the DCP group is the PCP group (DCP rank = PCP rank)", default="")
    tp: int | None = _key(C.int_in(1, MAX_WORLD_SIZE), "tensor-parallel size")
    num_speculative_tokens: int | None = _key(C.int_in(0, MAX_SPECULATIVE_TOKENS),
                                              "K: draft phases draft_0..draft_{K-1} per step")
    block_size: int | None = _key(C.int_in(1, MAX_BLOCK_SIZE), "KV block size (of the first KV-cache group)")
    block_sizes: tuple[int, ...] | None = _key(C.block_sizes, "KV block size per KV-cache group")
    shard_decode_requests: bool | None = _key(C.is_bool, "decodes sharded over the PCP ranks")
    num_steps: int | None = _key(C.int_in(0, C.INT64 - 1), "steps every rank recorded")
    num_requests: int | None = _key(C.int_in(0, MAX_COUNT), "requests of the run")
    max_new_tokens: int | None = _key(C.int_in(1, MAX_COUNT), "tokens generated per request")
    max_num_batched_tokens: int | None = _key(C.int_in(1, MAX_COUNT), "per-step token budget")
    max_num_seqs: int | None = _key(C.int_in(1, MAX_COUNT), "request slots")
    max_model_len: int | None = _key(C.int_in(1, MAX_COUNT), "context length")
    vocab_size: int | None = _key(C.int_in(1, MAX_COUNT), "vocabulary size")
    seed: int | None = _key(C.int_in(-C.INT64, C.INT64 - 1), "random seed")
    inject: tuple[str, ...] = _key(C.str_list, "injected faults (pcpviz.faults)", default=())
    model: str | None = _key(C.is_str, "model name or path")
    device: str | None = _key(C.is_str, "cpu or cuda")
    vllm_version: str | None = _key(C.is_str, "vLLM version of the producer")
    speculative_method: str | None = _key(C.is_str, "mtp, eagle, dspark, ...")
    cudagraph_mode: str | None = _key(C.is_str, "vLLM's resolved cudagraph_mode (NONE, PIECEWISE, "
                                      "FULL_AND_PIECEWISE, ...)")
    vllm_fixes: tuple[str, ...] = _key(C.str_list, "pcpviz's opt-in vLLM patches the run had on (PCPVIZ_FIXES)",
                                       default=())
    model_moe: bool | None = _key(C.is_bool, "the model has routed experts (vLLM: its MoE layers gather and "
                                  "reduce-scatter over PCP)")
    prompt_token_ids: tuple[tuple[int, ...], ...] | Mapping[str, tuple[int, ...]] | None = _key(
        C.token_ids, "prompt token ids per request")
    prompts: tuple[Any, ...] | None = _key(C.prompt_list, "the prompts as given (text, token ids or an object)")
    dtype: str | None = _key(C.is_str, "the model's dtype (float32, bfloat16)")
    gpus: tuple[str, ...] = _key(C.str_list, "the GPU of each rank (the vLLM plugin)", default=())
    launch: LaunchMeta | None = _key(C.launch_object, "the vLLM plugin's launch: llm_kwargs, sampling, env",
                                     decode=LaunchMeta.decode)
    speculative_config: Mapping[str, Any] | None = _key(C.json_object, "vLLM's speculative_config (the replay)")
    stand_ins: Mapping[str, Any] | None = _key(C.json_object, "what the CPU replay stands in for (name -> why)")
    replay_models: str | None = _key(C.is_str, "the CPU replay's models: tiny or scripted")
    backend: str | None = _key(C.is_str, "the collectives' backend (gloo, nccl)")
    vllm_spec_decode_metrics: Mapping[str, Any] | None = _key(C.json_object, "vLLM's spec-decode counters")
    output_token_ids: tuple[tuple[int, ...], ...] | Mapping[str, tuple[int, ...]] | None = _key(
        C.token_ids, "the tokens generated per request (the vLLM plugin's launch)")
    speculator: str | None = _key(C.is_str, "the speculator's class (MTPSpeculator, DSparkSpeculator)")
    torch_version: str | None = _key(C.is_str, "torch version of the producer")
    cuda_version: str | None = _key(C.is_str, "CUDA version torch was built with")
    python_version: str | None = _key(C.is_str, "Python version of the producer")
    hostname: str | None = _key(C.is_str, "the machine that recorded the trace")
    command: str | None = _key(C.is_str, "the recording process's command line")
    device_ring_overflow: Mapping[str, Any] | None = _key(C.json_object, "steps the vLLM plugin's device ring "
                                                          "dropped: steps, ring_bytes, before_step")
    flight_recorder: Mapping[str, Any] | None = _key(C.json_object, "a flight-recorder dump: what it kept and "
                                                     "what triggered it")
    vllm_configuration: str | None = _key(C.is_str, "why the run is no configuration vLLM 0.33.0 allows, if so")
    scenario: str | None = _key(C.is_str, "the CPU replay's scenario")
    scenario_description: str | None = _key(C.is_str, "what the replay's scenario exercises")
    models: str | None = _key(C.is_str, "the replay's models: what is real, what stands in")
    chunked_prefill: bool | None = _key(C.is_bool, "the replay's scenario chunks a prefill")
    dspark_status: str | None = _key(C.is_str, "what of DSpark the replay runs for real")
    serve: Mapping[str, Any] | None = _key(C.json_object, "the vllm serve run (tools/gpu/jobs.py): its command, "
                                           "requests")
    job: Mapping[str, Any] | None = _key(C.json_object, "the GPU job that recorded the trace (tools/gpu/jobs.py)")
    pcpviz_trace_schema: int = 1  # the schema version (checked by runmeta.check_version on reading)
    recorded: frozenset[str] = frozenset()  # the known keys run.json holds, well-formed and not null
    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # the keys pcpviz does not know

    # ---------------------------------------------------------------- what the keys mean together

    @property
    def kv_block_sizes(self) -> tuple[int, ...] | None:
        """The block size of each KV-cache group: ``block_sizes``, else ``(block_size,)``, else None."""
        if self.block_sizes:
            return self.block_sizes
        return None if self.block_size is None else (self.block_size,)

    @property
    def method(self) -> str:
        """The drafter: ``speculative_method``, ``mtp`` where not recorded."""
        return self.speculative_method or "mtp"

    @property
    def max_tokens(self) -> int | None:
        """Tokens generated per request: ``max_new_tokens``, else the launch's sampling ``max_tokens``."""
        launched = self.launch.sampling.get("max_tokens") if self.launch is not None else None
        return self.max_new_tokens or launched

    @property
    def device_text(self) -> str | None:
        """``device``, else what ``gpus`` says (``"2 x NVIDIA H200"``), else None."""
        if self.device:
            return self.device
        if self.gpus:
            return ", ".join(f"{n} x {name}" for name, n in Counter(self.gpus).items())
        return None

    @property
    def standard_rejection(self) -> bool:
        """False where the speculative config (top level or the launch's ``llm_kwargs``) asks vLLM
        for another rejection method than ``"standard"`` (vLLM 0.33.0 config/speculative.py:83,
        562: ``synthetic``, ``block``, ``fly``) or for synthetic acceptance, or where the CPU
        replay declares the rejection sampler a scripted stand-in (``stand_ins``)."""
        if self.stand_ins and self.stand_ins.get("rejection_sampler") and self.replay_models != "tiny":
            return False  # the replay's scripted acceptance (the tiny model's is greedy: the standard rule)
        launched = self.launch.llm_kwargs.get("speculative_config") if self.launch is not None else None
        for spec in (self.speculative_config, launched):
            if isinstance(spec, Mapping) and (spec.get("rejection_sample_method", "standard") not in (None, "standard")
                                              or spec.get("synthetic_acceptance_rates") is not None
                                              or spec.get("synthetic_acceptance_length") is not None):
                return False
        return True

    # ---------------------------------------------------------------- keys as data

    def recorded_value(self, key: str) -> Any:
        """The JSON value run.json records for ``key`` (a known key as decoded, an unknown one from
        ``extra``), None where it records none: for a reader that prints a list of keys."""
        if key in self.recorded:
            value = getattr(self, key)
            return value.to_json() if isinstance(value, LaunchMeta) else thawed_json(value)
        return thawed_json(self.extra.get(key))

    def without(self, keys: set[str] | frozenset[str]) -> "RunMeta":
        """This run.json less ``keys`` (their fields back to the default): what is left to trust
        once ``validate`` found those keys wrong."""
        gone = {k: _DEFAULTS[k] for k in keys if k in _DEFAULTS}
        return dataclasses.replace(self, **gone, recorded=self.recorded - set(gone))

    def to_json(self) -> dict[str, Any]:
        """The run.json document: the schema version, the recorded keys, then ``extra``."""
        out: dict[str, Any] = {"pcpviz_trace_schema": self.pcpviz_trace_schema}
        out.update((k, self.recorded_value(k)) for k in META_SCHEMA if k in self.recorded)
        return {**out, **thawed_json(self.extra)}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its document (read-only mappings do not pickle): decoded again on loading."""
        return _from_json, (self.to_json(),)

    # ---------------------------------------------------------------- producers

    @classmethod
    def build(cls, *, extra: Mapping[str, Any] | None = None, **keys: Any) -> "RunMeta":
        """What a producer writes, encoded from the type: each keyword a field (a name that is not
        is a TypeError, so a misspelled key fails where it is written, not as an unknown key in
        every trace), checked as a reader checks it (a malformed value is a ValueError naming the
        key), None meaning not recorded; ``extra``: keys of one's own, kept as they are. NumPy
        scalars and arrays are taken as their values. ``RunMeta.build(producer="x", pcp=2,
        block_size=16).pcp`` is 2; ``RunMeta.build(producer="x", pcp="2")`` raises ``ValueError:
        run.json key 'pcp': expected an int in 1..4096, got str '2'``."""
        unknown = sorted(k for k in keys if k not in META_SCHEMA)
        if unknown:
            raise TypeError(f"run.json: {', '.join(map(repr, unknown))} is no RunMeta field (pass keys of "
                            "one's own in extra=)")
        clash = sorted(set(extra or ()) & set(META_SCHEMA))
        if clash:
            raise TypeError(f"run.json: {', '.join(map(repr, clash))} in extra= is a RunMeta field: pass it by name")
        doc = _plain({**keys, **dict(extra or {})})
        meta, bad = decode_meta(doc)
        if bad:
            raise ValueError("; ".join(f"run.json key {k!r}: {why}" for k, why in bad))
        return dataclasses.replace(meta, pcpviz_trace_schema=SCHEMA_VERSION)

    def merged(self, **keys: Any) -> "RunMeta":
        """This run.json with ``keys`` set (checked as ``build`` checks them); keys not named stay."""
        doc = {k: v for k, v in self.to_json().items() if k != "pcpviz_trace_schema"}
        extra = {k: doc.pop(k) for k in list(doc) if k not in META_SCHEMA}
        return RunMeta.build(**{**doc, **keys}, extra=extra)


def _plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays as Python values, tuples as lists (JSON's own)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, LaunchMeta):
        return value.to_json()
    return value


def meta_document(meta: "RunMeta | Mapping[str, Any]") -> dict[str, Any]:
    """run.json's document of ``meta``: a ``RunMeta``'s own (``to_json``), a mapping as a dict."""
    return meta.to_json() if isinstance(meta, RunMeta) else dict(meta)


_KEY_FIELDS = tuple(f for f in dataclasses.fields(RunMeta) if "check" in f.metadata)
_DEFAULTS = {f.name: f.default for f in _KEY_FIELDS}

META_SCHEMA: Mapping[str, tuple[C.Check, bool, str]] = MappingProxyType(
    {f.name: (f.metadata["check"], f.metadata["required"], f.metadata["meaning"]) for f in _KEY_FIELDS})
"""The run.json keys pcpviz knows: key -> (check, required, meaning), from ``RunMeta``'s fields.
Other keys are allowed (``RunMeta.extra``). One of ``block_size`` / ``block_sizes`` is required too."""


def decode_meta(doc: Mapping[str, Any], *, version: int | None = None) -> tuple[RunMeta, tuple[tuple[str, str], ...]]:
    """``(RunMeta, malformed)`` of a run.json document: ``malformed`` holds ``(key, why)`` for each
    known key that is missing though required or fails its structure check (in ``META_SCHEMA``
    order); such a key keeps its default. ``version``: the schema version as the reader checked it
    (``runmeta.check_version``), else run.json's int. ``decode_meta({"producer": "x", "pcp": "2",
    "block_size": 16})`` gives ``pcp=None`` and ``(("pcp", "expected an int in 1..4096, got str
    '2'"),)``."""
    values: dict[str, Any] = {}
    recorded: set[str] = set()
    malformed: list[tuple[str, str]] = []
    for f in _KEY_FIELDS:
        key, check = f.name, f.metadata["check"]
        if key not in doc or (doc[key] is None and not f.metadata["required"]):
            if f.metadata["required"]:
                malformed.append((key, "required key is missing"))
            continue
        try:
            why = check(doc[key])
        except RecursionError:
            why = "nested too deeply"
        if why:
            malformed.append((key, why))
            continue
        values[key] = f.metadata["decode"](doc[key])
        recorded.add(key)
    version = doc.get("pcpviz_trace_schema") if version is None else version
    extra = {k: v for k, v in doc.items() if k not in META_SCHEMA and k != "pcpviz_trace_schema"}
    meta = RunMeta(**values, pcpviz_trace_schema=version if type(version) is int else 1,
                   recorded=frozenset(recorded), extra=frozen_json(extra))
    return meta, tuple(malformed)


def _from_json(doc: dict[str, Any]) -> RunMeta:
    return decode_meta(doc)[0]
