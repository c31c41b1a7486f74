"""The import audit (serve/audit.py, benchmarks/import_audit.py) on a real served engine: with
SPECPILOT_IMPORT_AUDIT set, the server process (not serve's) logs the files it imports, and the comparison with
the engine's manifest counts imported-and-kept, imported-but-pruned and kept-but-never-imported correctly."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from reference_runtime_helpers import free_port

from specpilot_build.assemble.builder import build_engine
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.serve.audit import compare_imports, module_name, package_path, static_importers
from specpilot_build.serve.process import read_record, serve, stop

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
EMBEDDED = "cpu_c1_stories260k_handwritten"


@pytest.fixture(scope="module")
def served_log(tmp_path_factory, session_data, golden):
    """(engine, log, server pid): the embedded final engine served with the audit on, one golden request, stopped."""
    engine = build_engine(EMBEDDED, "final").engine
    log = tmp_path_factory.mktemp("audit") / "imports.log"
    port = free_port()
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECPILOT_IMPORT_AUDIT", str(log))
    try:
        serve(engine, port, quiet=True)
        pid = read_record(port)["pid"]
        reply = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            timeout=60,
            json={"input_ids": golden["prompt_ids"], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        )
        assert reply.status_code == 200
    finally:
        stop(port)
        mp.undo()
    return engine, log, pid


@pytest.mark.slow
def test_the_served_process_logs_the_engine_files_it_imports(served_log):
    engine, log, pid = served_log
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert {row[0] for row in rows} == {str(pid)}  # the server wrote it; serve's own process did not
    assert str(pid) != str(os.getpid())
    files = {row[2] for row in rows}
    # the runtime is imported from the engine tree, not from the checkout
    assert str(engine.path / "runtime/specpilot_runtime/server.py") in files
    assert not any(f.startswith(str(REPO_ROOT / "runtimes")) for f in files)


@pytest.mark.slow
def test_the_comparison_counts_kept_pruned_and_never_imported(served_log, tmp_path):
    engine, log, _ = served_log
    manifest = [f["path"] for f in engine.manifest["files"]]
    kept = {p[len("runtime/") :] for p in manifest if p.startswith("runtime/specpilot_runtime/")}
    imported = {package_path(line.split("\t")[2], "specpilot_runtime") for line in log.read_text().splitlines()}
    imported.discard(None)
    audit = compare_imports(log, manifest, "specpilot_runtime")
    assert {"specpilot_runtime/server.py", "specpilot_runtime/model.py"} <= set(audit.imported_kept)
    assert audit.imported_pruned == ()
    assert set(audit.imported_kept) == imported and imported <= kept
    assert set(audit.kept_never_imported) == kept - imported
    assert audit.processes == 1
    # a tree that had pruned an imported file: named, and the script exits 1
    dropped = "runtime/specpilot_runtime/model.py"
    pruned = compare_imports(log, [p for p in manifest if p != dropped], "specpilot_runtime")
    assert pruned.imported_pruned == ("specpilot_runtime/model.py",)
    assert len(pruned.imported_kept) == len(audit.imported_kept) - 1
    script = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks/import_audit.py"), engine.id, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0, script.stderr
    assert "imported and kept  " in script.stdout
    assert [ln.split()[-1] for ln in script.stdout.splitlines() if ln.startswith("imported and pruned")] == ["0"]


def test_without_the_variable_the_launch_environment_is_untouched(monkeypatch):
    from specpilot_build.serve.audit import audit_env

    monkeypatch.delenv("SPECPILOT_IMPORT_AUDIT", raising=False)
    env = {"PYTHONPATH": "/e/python:/e/kernels"}
    assert audit_env(env) == env


def test_an_empty_or_malformed_log_is_one_clear_error(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("")
    with pytest.raises(SpecPilotError, match=r"empty.log is empty: was the engine served with SPECPILOT_IMPORT_AUDIT"):
        compare_imports(empty, [], "sglang")
    bad = tmp_path / "bad.log"
    bad.write_text("123\tsglang\n")
    with pytest.raises(SpecPilotError, match=r"bad.log: line 1 is not pid<TAB>module<TAB>file"):
        compare_imports(bad, [], "sglang")


def test_another_distributions_subpackage_of_the_same_name_is_not_counted(tmp_path):
    """Seen on the H200: smg_grpc_servicer ships smg_grpc_servicer/sglang/zmq_plugin.py; judged by its path alone it
    read as SGLang's own sglang/zmq_plugin.py, 'imported but pruned'. Membership is by module name."""
    log = tmp_path / "imports.log"
    log.write_text(
        "7\tsglang.srt.utils\t/p/engine/python/sglang/srt/utils.py\n"
        "7\tsmg_grpc_servicer.sglang.zmq_plugin\t/p/env/smg_grpc_servicer/sglang/zmq_plugin.py\n"
        "7\tsglang\t/p/engine/python/sglang/__init__.py\n"
    )
    audit = compare_imports(log, ["python/sglang/__init__.py", "python/sglang/srt/utils.py"], "sglang")
    assert audit.imported == ("sglang/__init__.py", "sglang/srt/utils.py")
    assert audit.imported_pruned == ()


def test_static_importers_name_the_files_whose_imports_reach_a_module(tmp_path):
    """What decides whether an unpruned run's extra imports matter: a kept file that names the module in an import
    statement — absolute, `from` or relative, at module level or lazily inside a function."""
    files = {
        "pkg/__init__.py": "",
        "pkg/models/__init__.py": "import pkgutil\n",
        "pkg/models/llama.py": "from pkg.layers import linear\n",
        "pkg/models/grok.py": "from ..layers.router import Router\n",
        "pkg/runner.py": "def load():\n    import pkg.kernels.fused as f\n    return f\n",
        "pkg/plugins.py": "import importlib\nLOADER = importlib.import_module('pkg.kernels.extra')\n",
        "pkg/kernels/extra.py": "",
        "pkg/layers/__init__.py": "",
        "pkg/layers/linear.py": "from . import quant\n",
        "pkg/layers/quant.py": "",
        "pkg/layers/router.py": "",
        "pkg/kernels/fused.py": "",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    modules = {
        "pkg.layers.linear",
        "pkg.layers.quant",
        "pkg.layers.router",
        "pkg.kernels.fused",
        "pkg.models.grok",
        "pkg.kernels.extra",
    }
    found = static_importers(tmp_path, [p for p in files if p != "pkg/models/grok.py"], modules)
    assert found == {
        "pkg.layers.linear": ["pkg/models/llama.py"],
        "pkg.layers.quant": ["pkg/layers/linear.py"],
        "pkg.layers.router": [],
        "pkg.kernels.fused": ["pkg/runner.py"],
        "pkg.models.grok": [],
        "pkg.kernels.extra": ["pkg/plugins.py"],
    }
    assert static_importers(tmp_path, list(files), {"pkg.layers.router"}) == {
        "pkg.layers.router": ["pkg/models/grok.py"]
    }
    assert module_name("pkg/models/__init__.py") == "pkg.models"
    (tmp_path / "pkg/broken.py").write_text("def f(:\n")
    with pytest.raises(SpecPilotError, match="pkg/broken.py"):
        static_importers(tmp_path, ["pkg/broken.py"], {"pkg.layers.router"})
