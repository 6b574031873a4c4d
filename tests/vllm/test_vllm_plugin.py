"""The pcpviz vLLM plugin, through vLLM's own plugin loader, and the real-GPU driver up to the
launch.

The entry point is installed for real (``pip install -e .`` of this repository registers
``[project.entry-points."vllm.general_plugins"] pcpviz``), and vLLM's
``vllm.plugins.load_general_plugins()`` runs it in fresh subprocesses: with
``PCPVIZ_TRACE_DIR`` set the runner's ``pcp_manager_cls`` resolves to the recording class and
the replay, built through that property, records a trace that passes the checks; unset,
nothing is patched; a faked wrong vLLM version or a missing attribute disables it with a
warning. Nothing is skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()

from pcpviz.analysis.checks import DCP_CHECKS, run_checks  # noqa: E402
from pcpviz.trace import open as open_trace  # noqa: E402
from pcpviz.vllm import launch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Scenario 1: inert without the variable, disabled on a wrong version, then enabled (the model
# runner module is imported by then, so it patches at once) and recording through the property.
SCRIPT_ENABLE = r"""
import json, logging, os, sys, time
out, trace_dir = sys.argv[1], sys.argv[2]
from pcpviz.vllm import cpu_patches
cpu_patches.apply_cpu_patches()  # imports the worker modules (cpu_patches.WORKER_MODULES)
import vllm, vllm.plugins
warnings = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("vllm.pcpviz").addHandler(Grab())
from pcpviz.vllm import plugin
res = {}

def hooks():
    return sum(type(f).__name__ == "_RunnerImportHook" for f in sys.meta_path)

os.environ.pop("PCPVIZ_TRACE_DIR", None)
t0 = time.perf_counter()
vllm.plugins.load_general_plugins()
res["unset"] = dict(status=plugin.status(), seconds=time.perf_counter() - t0, hooks=hooks(),
                    recording_imported="pcpviz.vllm.recording" in sys.modules)

vllm.plugins.plugins_loaded = False
os.environ["PCPVIZ_TRACE_DIR"] = trace_dir
real = vllm.__version__
vllm.__version__ = "0.34.0"
vllm.plugins.load_general_plugins()
vllm.__version__ = real
res["wrong_version"] = dict(status=plugin.status(), warnings=list(warnings), hooks=hooks(),
                            recording_imported="pcpviz.vllm.recording" in sys.modules)

from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.pcp_manager import PCPManager
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator
res["unpatched"] = dict(cls=GPUModelRunner.__dict__["pcp_manager_cls"].fget(None) is PCPManager,
                        propose_wrapped=hasattr(TargetDependentARSpeculator.propose, "_pcpviz_wrapper"))

plugin._status = "not registered"   # a fresh process: the same version, the variable set
vllm.plugins.plugins_loaded = False
vllm.plugins.load_general_plugins()
plugin.register()  # idempotent
cls = GPUModelRunner.__dict__["pcp_manager_cls"].fget(None)
from pcpviz.vllm import recording
res["enabled"] = dict(status=plugin.status(), cls=f"{cls.__module__}.{cls.__qualname__}",
                      is_subclass=issubclass(cls, PCPManager),
                      propose_wrapped=hasattr(TargetDependentARSpeculator.propose, "_pcpviz_wrapper"),
                      postprocess_wrapped=hasattr(GPUModelRunner.postprocess_sampled, "_pcpviz_wrapper"))

from pcpviz.vllm.replay import replay
r = replay(pcp=2, mtp=2, scenario="mixed")
res["replay"] = dict(manager_class=f"{r.manager_class.__module__}.{r.manager_class.__qualname__}",
                     trace_path=str(r.trace_path), steps=len(r.steps))
json.dump(res, open(out, "w"))
"""

# Scenario 2: registered before the model runner is imported (the import hook patches it), then
# a vLLM lacking a patched attribute: disabled, nothing patched.
SCRIPT_HOOK = r"""
import json, logging, os, sys
out = sys.argv[1]
from pcpviz.vllm import cpu_patches
cpu_patches.cpu_environment().__enter__()  # vLLM importable on CPU; the worker modules not imported yet
import vllm.plugins
warnings = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("vllm.pcpviz").addHandler(Grab())
from pcpviz.vllm import plugin
res = {}
assert "vllm.v1.worker.gpu.model_runner" not in sys.modules
vllm.plugins.load_general_plugins()
res["before_import"] = plugin.status()
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
cls = GPUModelRunner.__dict__["pcp_manager_cls"].fget(None)
res["after_import"] = dict(status=plugin.status(), cls=cls.__qualname__)

from pcpviz.vllm import recording
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator
recording.uninstall_wrappers()
del GPUModelRunner.pcp_manager_cls          # a vLLM without the hook
plugin._status = "not registered"
plugin.register()
res["missing"] = dict(status=plugin.status(), warnings=list(warnings),
                      has_property="pcp_manager_cls" in GPUModelRunner.__dict__,
                      propose_wrapped=hasattr(TargetDependentARSpeculator.propose, "_pcpviz_wrapper"))
json.dump(res, open(out, "w"))
"""


def _run_script(script: str, *args: str, env: dict | None = None) -> dict:
    out = Path(args[0])
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def enable_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    trace_dir = tmp / "trace"
    return _run_script(SCRIPT_ENABLE, str(tmp / "out.json"), str(trace_dir)), trace_dir


@pytest.fixture(scope="module")
def hook_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hook")
    return _run_script(SCRIPT_HOOK, str(tmp / "out.json"), env={"PCPVIZ_TRACE_DIR": str(tmp / "trace")})


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "pcpviz"]
    assert len(ours) == 1 and ours[0].value == "pcpviz.vllm.plugin:register"
    assert ours[0].load().__module__ == "pcpviz.vllm.plugin"


@pytest.mark.slow
def test_unset_variable_leaves_vllm_untouched(enable_run):
    res, _ = enable_run
    assert res["unset"]["status"] == "inactive"
    assert res["unset"]["hooks"] == 0 and not res["unset"]["recording_imported"]
    assert res["unset"]["seconds"] < 1.0  # vLLM's loader + an inert register()
    assert res["unpatched"] == {"cls": True, "propose_wrapped": False}


@pytest.mark.slow
def test_wrong_version_warns_and_disables(enable_run):
    res, _ = enable_run
    wv = res["wrong_version"]
    assert wv["status"].startswith("disabled: pcpviz records vLLM 0.33.0 only; this is vLLM 0.34.0")
    assert any("pcpviz plugin disabled" in w and "0.34.0" in w for w in wv["warnings"])
    assert wv["hooks"] == 0 and not wv["recording_imported"]
    assert res["unpatched"]["cls"]  # still vLLM's PCPManager afterwards


@pytest.mark.slow
def test_enabled_plugin_swaps_in_the_recording_manager(enable_run):
    res, _ = enable_run
    en = res["enabled"]
    assert en["status"] == "enabled"
    assert en["cls"] == "pcpviz.vllm.recording.manager.RecordingPCPManager" and en["is_subclass"]
    assert en["propose_wrapped"] and en["postprocess_wrapped"]


@pytest.mark.slow
def test_replay_through_the_plugins_classes_records_a_passing_trace(enable_run):
    res, trace_dir = enable_run
    assert res["replay"]["manager_class"] == "pcpviz.vllm.recording.manager.RecordingPCPManager"
    assert Path(res["replay"]["trace_path"]) == trace_dir
    t = open_trace(trace_dir)
    assert t.meta["producer"] == "vllm-plugin" and t.meta["vllm_version"] == "0.33.0"
    assert (t.meta["pcp"], t.meta["num_speculative_tokens"], t.meta["block_size"]) == (2, 2, 4)
    assert sorted(p.name for p in trace_dir.iterdir()) == ["complete.json", "rank0.arrow", "rank1.arrow", "run.json"]
    assert len(t.steps) == res["replay"]["steps"] == 5  # dummy runs are not recorded by default
    report = run_checks(t)
    # the plugin does not record the engine-only views (hidden-state fingerprints, top1_token):
    # only the checks that need them skip
    engine_only = {"hidden_restored", "hidden_handoffs", "target_outputs_agree", "verify_greedy"}
    # no graphs: graph_inputs_are_captured skips too
    skippable = engine_only | {"graph_inputs_are_captured"} | DCP_CHECKS  # and DCP = 1
    assert report.ok and set(report.skipped) <= skippable, report.format()


def test_a_v1_model_runner_is_one_warning_not_an_empty_directory(caplog):
    """Stand-in module for vLLM's V1 runner (building the real one needs a GPU config): the
    plugin's hook on its class says once that nothing is recorded."""
    import types

    from pcpviz.vllm import plugin

    class GPUModelRunner:
        def __init__(self, x):
            self.x = x

    module = types.SimpleNamespace(GPUModelRunner=GPUModelRunner)
    plugin._warn_on_v1_runner(module)
    plugin._warn_on_v1_runner(module)  # idempotent
    with caplog.at_level(logging.WARNING, logger="vllm.pcpviz"):
        GPUModelRunner(1), GPUModelRunner(2)
    lines = [r.getMessage() for r in caplog.records if "V1 model runner" in r.getMessage()]
    assert len(lines) == 1 and "VLLM_USE_V2_MODEL_RUNNER=1" in lines[0] and GPUModelRunner(3).x == 3


@pytest.mark.slow
def test_import_hook_patches_when_the_runner_module_loads(hook_run):
    assert hook_run["before_import"] == "pending"
    assert hook_run["after_import"] == {"status": "enabled", "cls": "RecordingPCPManager"}


@pytest.mark.slow
def test_missing_attribute_disables_without_patching(hook_run):
    m = hook_run["missing"]
    assert m["status"].startswith("disabled: this vLLM lacks GPUModelRunner.pcp_manager_cls")
    assert any("pcp_manager_cls" in w for w in m["warnings"])
    assert not m["has_property"] and not m["propose_wrapped"]


# --------------------------------------------------------------------------- recording policy


class _Manager:
    pcp_rank, pcp_world_size = 0, 2


def test_only_tp_rank_zero_records(monkeypatch, tmp_path):
    from pcpviz.vllm import recording

    s = recording.TraceSession(tmp_path, producer="vllm-plugin")
    monkeypatch.setattr(recording.sessions, "_tp_rank", lambda: 1)
    assert s.recorder_for(_Manager()) is None
    monkeypatch.setattr(recording.sessions, "_tp_rank", lambda: 0)
    assert s.recorder_for(_Manager()) is not None


def test_lenient_session_logs_and_disables_strict_raises(tmp_path, caplog):
    from pcpviz.vllm import recording

    def boom():
        raise KeyError("view")

    lenient = recording.TraceSession(tmp_path / "a", producer="vllm-plugin").recorder_for(_Manager())
    with caplog.at_level(logging.WARNING, logger="vllm.pcpviz"):
        assert lenient.guard(boom) is None
    assert lenient.disabled and "recording disabled on PCP rank 0" in caplog.text
    assert recording.recorder_of(SimpleManager(lenient)) is None
    strict = recording.TraceSession(tmp_path / "b", producer="vllm-replay", strict=True).recorder_for(_Manager())
    with pytest.raises(KeyError):
        strict.guard(boom)


@pytest.mark.parametrize("name", [".writer.lock", "run.json", "rank0.arrow"])
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_planted_file_in_the_trace_dir_is_one_warning_never_a_block(tmp_path, caplog, name, kind):
    """A FIFO or a link (to a victim file) planted in $PCPVIZ_TRACE_DIR: the recorder's first
    step gives one warning naming the file and records nothing; it never blocks inside the vLLM
    worker, never raises into it, and never writes through the link."""
    from pcpviz.vllm import recording

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    d = tmp_path / "trace"
    d.mkdir()
    if kind == "fifo":
        os.mkfifo(d / name)
    else:
        (d / name).symlink_to(victim)
    rec = recording.TraceSession(d, producer="vllm-plugin").recorder_for(_Manager())
    with caplog.at_level(logging.WARNING, logger="vllm.pcpviz"):
        for _ in range(3):  # the next step's begin writes the pending one
            rec.guard(rec.begin_step)
            rec.guard(rec.put, "target", positions=np.arange(3))
        rec.close()
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert rec.disabled and len(warnings_) == 1 and name in warnings_[0], warnings_
    assert "Traceback" not in caplog.text
    assert victim.read_text() == "precious\n"
    assert not (d / "rank0.arrow").exists() or name == "rank0.arrow"


class SimpleManager:
    def __init__(self, rec):
        self._pcpviz_recorder = rec


# --------------------------------------------------------------------------- the GPU driver


def test_build_vllm_launch_exact_kwargs_argv_env(tmp_path):
    spec = launch.build_vllm_launch("data/models/pcpviz-tiny-dsv3", ["def f(", [1, 2, 3]], pcp=2, tp=1,
                                    num_speculative_tokens=1, trace_dir=tmp_path / "t", max_tokens=16,
                                    python="/usr/bin/python3", job_path="/tmp/job.json", base_env={})
    assert spec.llm_kwargs == {
        "model": "data/models/pcpviz-tiny-dsv3", "tensor_parallel_size": 1, "prefill_context_parallel_size": 2,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        "compilation_config": {"cudagraph_mode": "PIECEWISE"}, "enforce_eager": False, "seed": 0,
    }
    assert spec.sampling_kwargs == {"temperature": 0.0, "max_tokens": 16}
    assert spec.argv == ["/usr/bin/python3", "-u", "-m", "pcpviz.vllm.launch", "/tmp/job.json"]
    assert spec.env == {"PCPVIZ_TRACE_DIR": str((tmp_path / "t").absolute()), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert spec.prompts == ["def f(", {"prompt_token_ids": [1, 2, 3]}] and spec.num_gpus == 2
    eager = launch.build_vllm_launch("m", ["x"], pcp=4, tp=2, trace_dir=tmp_path / "u", cudagraph_mode="none",
                                     extra_engine_args={"max_model_len": 512},
                                     base_env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert eager.llm_kwargs["compilation_config"] == {"cudagraph_mode": "NONE"} and eager.llm_kwargs["enforce_eager"]
    assert eager.llm_kwargs["max_model_len"] == 512 and eager.num_gpus == 8
    assert eager.env["VLLM_PLUGINS"] == "lora_filesystem_resolver,pcpviz"


def test_launch_kwargs_are_vllms_own_argument_names(tmp_path):
    """Each vllm.LLM keyword built is an LLM.__init__ parameter or an EngineArgs field (LLM
    passes **kwargs to EngineArgs); the serve flags in the docs exist in vLLM's CLI."""
    from vllm import LLM
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    spec = launch.build_vllm_launch("m", ["x"], trace_dir=tmp_path / "t")
    llm_params = set(inspect.signature(LLM.__init__).parameters)
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in spec.llm_kwargs:
        assert key in llm_params or key in engine_fields, key
    assert {"prefill_context_parallel_size", "speculative_config"} <= engine_fields
    assert CompilationConfig(**spec.llm_kwargs["compilation_config"]).cudagraph_mode == CUDAGraphMode.PIECEWISE
    cli = inspect.getsource(EngineArgs.add_cli_args)
    for flag in ('"--prefill-context-parallel-size"', '"--speculative-config"', '"--compilation-config", "-cc"',
                 '"--tensor-parallel-size"'):
        assert flag in cli, flag
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--compilation-config", "-cc", type=json.loads)
    assert parser.parse_args(["-cc.cudagraph_mode=PIECEWISE"]).compilation_config == {"cudagraph_mode": "PIECEWISE"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(pcp=0), "pcp must be an int >= 1"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an int >= 1"),
    (dict(cudagraph_mode="FULL_DECODE_ONLY"), "cudagraph_mode must be one of PIECEWISE, NONE, FULL_AND_PIECEWISE"),
    (dict(prompts=[]), "prompts must be a non-empty list"),
    (dict(prompts=[3.5]), "a prompt must be a string or a list of token ids"),
    (dict(extra_engine_args={"model": "x"}), "must not set 'model'"),
])
def test_build_vllm_launch_rejects_bad_configurations(tmp_path, kwargs, message):
    args = dict(prompts=["x"], trace_dir=tmp_path / "t")
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        launch.build_vllm_launch("m", args.pop("prompts"), **args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_run_refuses_an_existing_trace(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "rank0.arrow").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds a trace"):
        launch.run("m", ["x"], trace_dir=tmp_path / "t")


def test_run_without_gpus_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_visible_gpus", lambda: 0)  # a machine without GPUs
    with pytest.raises(launch.LaunchError) as e:
        launch.run("data/models/pcpviz-tiny-dsv3", ["x"], pcp=2, tp=2, trace_dir=tmp_path / "t", progress=False)
    assert str(e.value).startswith("pcp*tp = 4 GPUs needed, torch sees 0") and "\n" not in str(e.value)
    assert not (tmp_path / "t").exists()  # nothing launched, nothing written


def test_run_without_vllm_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_installed_vllm_version", lambda: None)
    with pytest.raises(launch.LaunchError) as e:
        launch.run("m", ["x"], trace_dir=tmp_path / "t", progress=False)
    assert str(e.value).startswith("vLLM is not installed") and "\n" not in str(e.value)
    monkeypatch.setattr(launch, "_installed_vllm_version", lambda: "0.32.1")
    with pytest.raises(launch.LaunchError, match="needs vLLM 0.33.0; vLLM 0.32.1 is installed"):
        launch.run("m", ["x"], trace_dir=tmp_path / "t", progress=False)


def test_package_exports_run():
    import pcpviz.vllm

    assert pcpviz.vllm.run is launch.run and pcpviz.vllm.build_vllm_launch is launch.build_vllm_launch
