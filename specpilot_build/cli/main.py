"""`specpilot`: every verb's parser, in one place. Stages return data and raise typed errors; this module
prints the data and turns the errors into one line and an exit code (a traceback only with SPECPILOT_DEBUG=1)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specpilot_build.defaults import ARMS, DEFAULT_PORT, DEFAULT_SETTING, ORACLE_PORT
from specpilot_build.errors import SpecPilotError, debug_enabled
from specpilot_build.measure.datasets import SPLITS


def port_number(text: str) -> int:
    """argparse type of every --port: a TCP port 1..65535, else argparse's one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is outside the port range 1..65535")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.handler(args) or 0)
    except SpecPilotError as exc:
        if debug_enabled():
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`specpilot diff A B | head`): stop quietly, like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # a bug, not a user error: still one line unless asked for the traceback
        if debug_enabled():
            raise
        print(
            f"error: internal error in `specpilot {args.verb}`: {type(exc).__name__}: {exc} "
            f"(SPECPILOT_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 70


def console():
    """A rich console that never cuts or wraps when the output is a pipe or a file (full ids and paths)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=100_000, soft_wrap=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specpilot",
        description="Declarative builds of speculative-decoding "
        "engines: a Hydra setting becomes a content-addressed engine you serve, "
        "bench and verify by its id.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    engine = verbs.add_parser(
        "engine", help="build an engine, or inspect and maintain the store (build, check, show, ls, fsck, rm, gc)"
    )
    store = engine.add_subparsers(dest="engine_verb", required=True, metavar="ACTION")
    p = store.add_parser("build", help="build (or find) the engine of a setting and arm; prints id and path")
    p.add_argument("--setting", default=DEFAULT_SETTING)
    p.add_argument("--arm", default="final", choices=ARMS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. drafter.num_draft_tokens=6")
    p.set_defaults(handler=_engine_build)
    from specpilot_build.store.maintain import EXIT_CODES_HELP

    p = store.add_parser(
        "check",
        help="re-hash an engine and compare its whole listing with its manifest; --repair mends it",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("engine")
    p.add_argument(
        "--repair",
        action="store_true",
        help="re-link damaged files from good objects, re-make damaged "
        "objects from the pinned base wheel, the checkout or a rebuild; name what cannot be mended",
    )
    p.set_defaults(handler=_engine_check)
    p = store.add_parser("show", help="setting, arm, pins, mechanisms and size of an engine")
    p.add_argument("engine")
    p.set_defaults(handler=_engine_show)
    store.add_parser("ls", help="list the engines in the store (damaged directories with the reason)").set_defaults(
        handler=_engine_ls
    )
    p = store.add_parser(
        "fsck", help="hash every object and check every engine in the store; counts printed", epilog=EXIT_CODES_HELP
    )
    p.add_argument("--repair", action="store_true", help="delete damaged objects, reset modes, repair engines")
    p.set_defaults(handler=_engine_fsck)
    p = store.add_parser(
        "rm",
        help="remove engines (damaged ones too); refuses one being served or in engines/.roots",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("engines", nargs="+", help="engine ids or unique prefixes")
    p.add_argument("--force", action="store_true", help="remove even an engine being served or listed as a root")
    p.set_defaults(handler=_engine_rm)
    p = store.add_parser(
        "gc", help="remove unreferenced objects, stale temporary trees, dangling index entries", epilog=EXIT_CODES_HELP
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument(
        "--engines",
        action="store_true",
        help="also remove every engine that is neither served (a live "
        "run record) nor listed in engines/.roots (one id per line)",
    )
    p.set_defaults(handler=_engine_gc)

    p = verbs.add_parser(
        "push", help="copy an engine to a binary cache: objects, manifest, then an entry signed with --key"
    )
    p.add_argument("engine", help="engine id or unique prefix")
    _cache_arguments(p)
    _key_argument(p)
    _progress_argument(p)
    p.set_defaults(handler=_push)
    p = verbs.add_parser(
        "pull", help="copy an engine from a binary cache into the store; signature, manifest and objects checked"
    )
    p.add_argument("engine", help="engine id, or a unique prefix of one the cache holds")
    _cache_arguments(p)
    _progress_argument(p)
    p.set_defaults(handler=_pull)
    cache = verbs.add_parser("cache", help="binary caches of engines (ls, check, gc, keygen)")
    caches = cache.add_subparsers(dest="cache_verb", required=True, metavar="ACTION")
    p = caches.add_parser("ls", help="the signed entries of a cache: build key, engine, setting, arm, signer")
    _cache_arguments(p)
    p.set_defaults(handler=_cache_ls)
    p = caches.add_parser(
        "check", help="re-check a cache: every entry's signature, manifest against its id, object against its hash"
    )
    _cache_arguments(p)
    p.set_defaults(handler=_cache_check)
    p = caches.add_parser("gc", help="remove manifests no entry names and objects no manifest lists")
    _cache_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="keep what is younger than this many seconds (a push in progress; default 3600)",
    )
    p.set_defaults(handler=_cache_gc)
    p = caches.add_parser(
        "import", help="push the engines of a bundle (checked as the installer checks it) into a cache, signed"
    )
    p.add_argument("bundle", type=Path, help="the bundle's folder (index.json and its parts)")
    _cache_arguments(p)
    _key_argument(p)
    _progress_argument(p)
    p.set_defaults(handler=_cache_import)
    p = caches.add_parser("keygen", help="a new ed25519 key pair: writes the secret, prints the public key")
    p.add_argument("name", help="the key's name (signer id), e.g. ci-1")
    p.add_argument("--out", type=Path, default=None, help="secret key file (default <data>/cache-keys/NAME.secret)")
    p.set_defaults(handler=_cache_keygen)

    p = verbs.add_parser("sweep", help="build many setting x arm engines as one Hydra multirun; summary table")
    p.add_argument("--settings", required=True, help="comma-separated setting names")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--launcher", default=None, help="Hydra launcher config: local (joblib) or slurm")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every job")
    p.set_defaults(handler=_sweep)

    p = verbs.add_parser("tune", help="search the final arm's mechanism with Optuna on the tune split, lossless only")
    p.add_argument("--setting", default=DEFAULT_SETTING)
    p.add_argument("--space", default="ngram", help="conf/tune/<space>.yaml")
    p.add_argument("--trials", type=int, default=8, help="the study's size (a resumed study runs the rest)")
    p.add_argument("--sampler", choices=("tpe", "grid", "random"), default="tpe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--study", default=None, help="study name (default <setting>-<space>)")
    p.add_argument("--limit", type=int, default=2, help="tune-split items per dataset per trial")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--datasets", default=None, help="comma-separated subset of the benchmarks")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="ar, stock, final on PORT..PORT+2")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a trial may take")
    p.add_argument(
        "--promote",
        action="store_true",
        help="confirm the winner on the dev split against the current final; make it the final only if faster "
        "(95%% CI above 1) and lossless",
    )
    p.add_argument("--eval-limit", type=int, default=2, help="dev items per dataset the confirmation benches")
    p.add_argument(
        "--leaders",
        type=int,
        default=3,
        help="distinct best points re-benched side by side on the tune split before the winner is chosen (0: off)",
    )
    p.add_argument(
        "--launcher",
        default=None,
        help="run each trial as a Hydra job through conf/hydra/launcher/<name> (submitit_local, slurm, ...)",
    )
    p.set_defaults(handler=_tune)

    p = verbs.add_parser("lock", help="pin a setting's model and drafter repos to commits, files to sha256")
    p.add_argument("--setting", required=True)
    p.add_argument("--update", action="store_true", help="re-resolve `main` even for repos already pinned")
    p.set_defaults(handler=_lock)

    p = verbs.add_parser(
        "env",
        help="an SGLang engine's environment on a GPU host: host profiles, the environment lock, installing it pruned",
    )
    env = p.add_subparsers(dest="env_verb", required=True, metavar="ACTION")
    q = env.add_parser(
        "lock",
        help="resolve the wheels RUNTIME needs on HOST beyond what the host has "
        "(pip's resolver for the host's platform) into lockfiles/envs/RUNTIME@HOST.toml",
    )
    q.add_argument("--runtime", required=True, help="a wheel runtime of lockfiles/runtimes.toml, e.g. sglang-0.5.17")
    q.add_argument("--host", required=True, help="a host profile, lockfiles/hosts/HOST.toml")
    q.set_defaults(handler=_env_lock)
    q = env.add_parser(
        "host-profile", help="write lockfiles/hosts/HOST.toml from the host's `pip list --format=freeze`"
    )
    q.add_argument("--freeze", required=True, type=Path)
    q.add_argument("--host", required=True, help="the profile's name: writes lockfiles/hosts/HOST.toml")
    q.add_argument("--python", required=True, help="the host's full Python version, e.g. 3.12.3")
    q.add_argument("--glibc", required=True, help="the host's glibc (ldd --version), e.g. 2.39")
    q.add_argument("--cuda", required=True, type=int, help="the host's CUDA major (nvidia-smi), e.g. 13")
    q.set_defaults(handler=_env_host_profile)
    q = env.add_parser(
        "install", help="fetch, check, unpack and prune a setting's environment into a prefix (what the bundle carries)"
    )
    q.add_argument("--setting", required=True)
    q.add_argument("--arm", default="final", choices=ARMS)
    q.add_argument("--target", required=True, type=Path, help="a new directory (the prefix)")
    q.add_argument("overrides", nargs="*")
    q.set_defaults(handler=_env_install)

    p = verbs.add_parser("models", help="fetch and verify exactly a setting's pinned checkpoint files")
    p.add_argument("--setting", required=True)
    p.add_argument(
        "--mirror",
        type=Path,
        help="offline mirror of pinned files (default: $SPECPILOT_MIRROR, else ../shared beside the checkout)",
    )
    p.set_defaults(handler=_models)

    p = verbs.add_parser("draft", help="make a drafter from a setting's target by a recipe; store it, pin it")
    p.add_argument("--setting", required=True, help="whose model is the target")
    p.add_argument("--recipe", help="conf/recipe/<name>.yaml (default: the recipe of the setting's final drafter)")
    p.add_argument("overrides", nargs="*", help="recipe overrides, key=value (e.g. train.steps=400)")
    p.set_defaults(handler=_draft)

    p = verbs.add_parser(
        "draft-import", help="admit a drafter made elsewhere: its id recomputed here, then stored and pinned"
    )
    p.add_argument("bundle", type=Path, help="a bundle of benchmarks/draft_gpu.sh: drafter/, data.json, pin.toml")
    p.add_argument("overrides", nargs="*", help="the recipe overrides it was made with, key=value")
    p.set_defaults(handler=_draft_import)

    p = verbs.add_parser("serve", help="re-hash, gate, and serve exactly one engine tree; waits for health")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--engine", help="engine id or unique prefix")
    what.add_argument("--setting", help="build (or find) this setting's engine first")
    p.add_argument("--arm", default="final", choices=ARMS)
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--ignore-hardware", action="store_true", help="serve even if the GPU differs (experts)")
    p.add_argument("--dry-run", action="store_true", help="print the exact command and environment")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    p.set_defaults(handler=_serve)

    p = verbs.add_parser("stop", help="stop exactly the recorded server process group on a port")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    p.set_defaults(handler=_stop)

    p = verbs.add_parser("bench", help="the dev splits' first turns, greedy, through the server of one engine id")
    p.add_argument("--engine", required=True, help="engine id or unique prefix (served on --port)")
    p.add_argument("--run", required=True, help="run name: writes <data>/results/<run>.json")
    p.add_argument("--limit", type=int, default=None, help="items per dataset (default: whole split)")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    p.add_argument("--datasets", default=None, help="comma-separated subset of the dev splits")
    p.add_argument("--split", choices=SPLITS, default="dev", help="which split (tune: the prompts a search may see)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run of that name")
    p.add_argument(
        "--oracle",
        default=None,
        help="the setting's ar engine by id, already in the store (default: build or find it from this "
        "checkout; on a host without the builder, e.g. an installed bundle, name it)",
    )
    p.set_defaults(handler=_bench)

    p = verbs.add_parser("compare", help="speedups with 95%% CIs and output identity of ar, stock and final runs")
    p.add_argument("--ar", required=True, help="results of the ar arm (path or run name)")
    p.add_argument("--stock", required=True, help="results of the stock arm")
    p.add_argument("--final", required=True, help="results of the final arm")
    p.add_argument("--report", help="report name (default compare_<final run name>)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier report of that name")
    p.set_defaults(handler=_compare)

    p = verbs.add_parser("gaps", help="the cost model: where a token's time goes against the hardware's ceilings")
    p.add_argument("--engine", required=True, help="engine id or unique prefix the run benched")
    p.add_argument("--run", required=True, help="a c1 bench run of that engine (path or run name)")
    p.set_defaults(handler=_gaps)

    p = verbs.add_parser("attest", help="check an in-toto statement written by verify or compare")
    attest = p.add_subparsers(dest="attest_verb", required=True, metavar="ACTION")
    a = attest.add_parser("check", help="re-hash every subject of a statement; non-zero exit on any change")
    a.add_argument("statement", help="a .intoto.json file written next to a verify or compare report")
    a.set_defaults(handler=_attest_check)

    from specpilot_build.measure.sandbox import Limits

    p = verbs.add_parser("score", help="grade a bench run: answers, and code run against its tests in a sandbox")
    p.add_argument("run", help="results JSON written by bench: a path or a run name")
    p.add_argument("--workers", type=int, default=None, help="sandboxed programs run in parallel")
    p.add_argument("--cpu-seconds", type=int, default=Limits.cpu_s, help="CPU-time limit per program")
    p.add_argument("--wall-seconds", type=float, default=Limits.wall_s, help="wall-clock limit per program")
    p.set_defaults(handler=_score)

    p = verbs.add_parser("verify", help="token forcing: every emitted token is the target's own greedy choice")
    p.add_argument("run", help="results JSON path or run name")
    p.add_argument(
        "--oracle",
        help="oracle engine id (default: the run's recorded oracle, built only if the build gives exactly that id)",
    )
    p.add_argument("--port", type=port_number, default=ORACLE_PORT)
    p.add_argument("--tolerance", type=float, help="near-tie log-prob margin (default: from the dtype)")
    p.add_argument("--concurrency", type=int)
    p.set_defaults(handler=_verify)

    p = verbs.add_parser("diff", help="why two engines have different ids (exit 0 same, 1 different, 2 error)")
    p.add_argument("a", help="engine id (or a unique prefix)")
    p.add_argument("b", help="engine id (or a unique prefix)")
    p.add_argument("--json", action="store_true", help="print the diff as JSON")
    p.add_argument("--files", action="store_true", help="show unified diffs of changed text files")
    p.set_defaults(handler=_diff)

    p = verbs.add_parser(
        "bundle",
        help="engines, their models, environment and SpecPilot as one archive in parts, "
        "with an index and a standard-library installer, for an air-gapped host",
    )
    p.add_argument(
        "engines", nargs="+", metavar="ENGINE", help="engine id(s) or unique prefixes (one prefix serves them all)"
    )
    p.add_argument(
        "--host", default=None, help="host profile (lockfiles/hosts/<host>.toml) whose environment to include"
    )
    p.add_argument(
        "--env",
        type=Path,
        default=None,
        help="an environment directory to include as <prefix>/env (first on the engine's PYTHONPATH after its tree)",
    )
    p.add_argument("--part-mb", type=float, default=60.0, help="largest part in MiB (default 60; the host takes 64)")
    p.add_argument("--out", type=Path, default=None, help="folder to write (default <data>/bundles/<archive id>)")
    p.add_argument(
        "--cache",
        default=None,
        help="take the engines from this binary cache (pulled and verified into a scratch store), not the store",
    )
    p.add_argument("--trust", action="append", default=[], help="with --cache: also trust this public key (name:hex)")
    _progress_argument(p)
    p.set_defaults(handler=_bundle)

    p = verbs.add_parser("demo", help="build, serve, bench, compare, score and verify one setting's three arms")
    p.add_argument("--setting", default=DEFAULT_SETTING)
    p.add_argument("--limit", type=int, default=3, help="items per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    p.add_argument("--datasets", default=None, help="comma-separated subset of the dev splits")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="bench the three arms side by side this many times, "
        "each on fresh servers, and print the run-to-run spread of final/ar",
    )
    p.set_defaults(handler=_demo)
    return parser


# --- engine and store ----------------------------------------------------------------------------------------


def _engine_build(args) -> int:
    from specpilot_build.assemble.builder import build_engine, describe

    result = build_engine(args.setting, args.arm, args.overrides)
    for note in result.notes:
        print(note, file=sys.stderr)
    print(describe(result))
    return 0


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, help="the cache's URL (default: the first of cache.substituters)")
    p.add_argument("--trust", action="append", default=[], help="also trust this public key (name:hex); repeatable")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the cache group, e.g. cache=team")


def _key_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key",
        type=Path,
        default=None,
        help="secret key file that signs the entries (default $SPECPILOT_CACHE_KEY; `specpilot cache keygen`)",
    )


def _signing_key(args):
    from specpilot_build.cache.signing import load_signing_key

    secret = args.key or (Path(os.environ["SPECPILOT_CACHE_KEY"]) if os.environ.get("SPECPILOT_CACHE_KEY") else None)
    if secret is None:
        raise SpecPilotError(
            f"{args.verb if args.verb != 'cache' else 'cache import'} signs its entries: pass --key FILE "
            "(make ... KEY=FILE) or set SPECPILOT_CACHE_KEY; `specpilot cache keygen NAME` makes a key pair"
        )
    return load_signing_key(secret)


def _progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (bytes, rate, time left); default: only when stderr is a terminal",
    )


def _cache_of(args):
    """(the cache named by --cache or the config's first substituter, the cache settings)."""
    from specpilot_build.cache.remote import BinaryCache
    from specpilot_build.cache.settings import cache_settings
    from specpilot_build.config.compose import compose_setting

    overrides = [o for o in args.overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0] == "cache"]
    if overrides != list(args.overrides):
        bad = next(o for o in args.overrides if o not in overrides)
        raise SpecPilotError(f"override {bad!r}: only the cache group (cache=..., cache.<key>=...) applies here")
    settings = cache_settings(compose_setting(DEFAULT_SETTING, "final", overrides).config, args.trust)
    url = args.cache or (settings.substituters[0] if settings.substituters else None)
    if url is None:
        raise SpecPilotError("no cache: pass --cache URL (make ... CACHE=URL) or set cache.substituters")
    return BinaryCache(url), settings


def _push(args) -> int:
    from specpilot_build.cache.progress import meter_for
    from specpilot_build.cache.push import push_engine
    from specpilot_build.store.engines import resolve_engine, store_root

    cache, _ = _cache_of(args)
    key = _signing_key(args)
    summary = push_engine(resolve_engine(args.engine), cache, key, store_root(), meter=meter_for(args.progress))
    print(summary.line(cache))
    return 0


def _pull(args) -> int:
    from specpilot_build.cache.progress import meter_for
    from specpilot_build.cache.pull import pull_engine
    from specpilot_build.store.engines import store_root

    cache, settings = _cache_of(args)
    pulled = pull_engine(cache, args.engine, settings.trusted, store_root(), meter=meter_for(args.progress))
    for note in pulled.notes:
        print(f"warning: {note}", file=sys.stderr)
    print(pulled.summary(cache))
    return 0


def _cache_ls(args) -> int:
    from specpilot_build.cache.maintain import list_entries

    cache, settings = _cache_of(args)
    entries = list_entries(cache, settings.trusted)
    for e in entries:
        state = "ok" if e.problem is None else "REFUSED: " + e.problem
        print(f"{e.build_key[:12]}  {e.engine[:12]}  {e.setting}  {e.arm}  signer {e.signer}  {state}")
    print(f"{cache}: {len(entries)} entries, {sum(e.problem is None for e in entries)} signed by a trusted key")
    return 0


def _cache_check(args) -> int:
    from specpilot_build.cache.maintain import check_cache

    cache, settings = _cache_of(args)
    report = check_cache(cache, settings.trusted)
    for line in report.problems:
        print(line)
    print(
        f"{cache}: {report.entries} entries, {report.manifests} manifests, {report.objects} objects "
        f"({report.packs} packs); "
        f"{len(report.problems)} problem(s)"
    )
    return 1 if report.problems else 0


def _cache_gc(args) -> int:
    from specpilot_build.cache.maintain import gc_cache

    cache, _ = _cache_of(args)
    report = gc_cache(cache, grace_s=args.grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for rel in report.removed:
        print(f"{verb} {cache.where(rel)}")
    print(f"{cache}: {verb} {len(report.removed)}; kept {report.kept_young} younger than {args.grace:g} s")
    return 0


def _build_of(setting: str, arm: str) -> tuple[dict, str]:
    """The head a build of `setting`/`arm` records and its build key (what `cache import` keys a bundle's engines by)."""
    from specpilot_build.assemble.builder import build_head, build_key
    from specpilot_build.config.compose import compose_setting

    head = build_head(compose_setting(setting, arm))[1]
    return head, build_key(head)


def _cache_import(args) -> int:
    import shutil

    from specpilot_build.bundle.caches import import_bundle, scratch_dir
    from specpilot_build.cache.progress import meter_for
    from specpilot_build.locations import data_dir

    cache, _ = _cache_of(args)
    key = _signing_key(args)
    scratch = scratch_dir(data_dir(), "cache-import")
    try:
        summaries = import_bundle(args.bundle, cache, key, scratch, _build_of, meter=meter_for(args.progress))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for summary in summaries:
        print(summary.line(cache))
    return 0


def _cache_keygen(args) -> int:
    from specpilot_build.cache.signing import keygen
    from specpilot_build.locations import data_dir

    out = args.out or data_dir() / "cache-keys" / f"{args.name}.secret"
    key = keygen(args.name, out)
    print(f"wrote the secret key {out} (keep it private; push --key {out})")
    print(f"public key (add it to cache.trusted_public_keys): {key.public_line()}")
    return 0


def _engine_check(args) -> int:
    from specpilot_build.assemble.repair import repair_engine
    from specpilot_build.store.engines import check_engine, resolve_engine
    from specpilot_build.store.maintain import EXIT_DAMAGED

    engine = resolve_engine(args.engine)
    if args.repair:
        report = repair_engine(engine)
        for line in report.repaired:
            print(f"{engine.id[:12]}: repaired {line}")
        for line in report.unrepairable:
            print(f"{engine.id[:12]}: cannot repair {line}")
        if report.unrepairable:
            print(
                f"engine {engine.id[:12]}: {len(report.unrepairable)} difference(s) could not be repaired; remove "
                f"it with `specpilot engine rm {engine.id[:12]}` and build its setting again"
            )
        else:
            print(
                f"engine {engine.id[:12]}: {len(report.found)} difference(s) repaired; "
                f"{len(engine.manifest['files'])} files match the manifest"
            )
        return report.exit_code
    problems = check_engine(engine)
    for line in problems:
        print(f"{engine.id[:12]}: {line}")
    if problems:
        print(
            f"engine {engine.id[:12]}: {len(problems)} file(s) differ from its manifest; "
            f"`specpilot engine check --repair {engine.id[:12]}` mends them"
        )
        return EXIT_DAMAGED
    print(f"engine {engine.id[:12]}: {len(engine.manifest['files'])} files match the manifest")
    return 0


def _engine_fsck(args) -> int:
    from specpilot_build.assemble.repair import fsck

    report = fsck(repair=args.repair)
    for line in report.objects_bad + report.objects_mode:
        print(line)
    for eid, lines in report.engines_bad.items():
        for line in lines:
            print(f"{eid[:12]}: {line}")
    for damaged in report.damaged:
        print(f"{damaged.id[:12]}: {damaged.advice()}")
    for repair in report.repairs:
        for line in repair.unrepairable:
            print(f"{repair.engine.id[:12]}: cannot repair {line}")
    print(
        f"checked {report.objects} objects ({len(report.objects_bad)} damaged, {len(report.objects_mode)} with "
        f"a wrong mode, {report.temporaries} temporaries) and {report.engines + len(report.damaged)} engines "
        f"({len(report.engines_bad)} with differing files, {len(report.damaged)} damaged directories) "
        f"in {report.seconds:.2f} s" + (f"; repaired {len(report.repairs)} engines" if args.repair else "")
    )
    if report.exit_code == 1:
        print("`specpilot engine fsck --repair` (or `engine check --repair <id>`) mends them")
    return report.exit_code


def _engine_rm(args) -> int:
    from specpilot_build.store.maintain import remove_engine

    for ref in args.engines:
        print(f"removed {remove_engine(ref, force=args.force)}")
    return 0


def _engine_gc(args) -> int:
    from specpilot_build.store.maintain import gc

    report = gc(dry_run=args.dry_run, engines=args.engines)
    verb = "would remove" if args.dry_run else "removed"
    for eid in report.engines:
        print(f"{verb} engine {eid}")
    for path in report.temporaries + report.index_entries:
        print(f"{verb} {path}")
    for eid, why in report.kept.items():
        print(f"kept engine {eid[:12]}: {why}")
    print(
        f"{verb} {len(report.engines)} engines, {report.objects} unreferenced objects "
        f"({report.object_bytes:,} bytes), {len(report.temporaries)} temporaries, "
        f"{len(report.index_entries)} dangling index entries"
    )
    return 0


def _engine_show(args) -> int:
    from rich.table import Table

    from specpilot_build.store.engines import resolve_engine

    engine = resolve_engine(args.engine)
    m = engine.manifest
    files = m["files"]
    table = Table(show_header=False, box=None)
    rows = [
        ("engine", engine.id),
        ("path", str(engine.path)),
        ("setting", m["setting"]),
        ("arm", m["arm"]),
        ("choices", ", ".join(f"{k}={v}" for k, v in sorted(m["choices"].items()))),
        ("runtime", _runtime_line(m["inputs"]["runtime"])),
    ]
    for role, pin in m["inputs"]["checkpoints"].items():
        if pin:
            locked = f", {len(pin.get('files', []))} files locked" if pin.get("files") else ""
            rows.append((role, f"{pin['repo']}@{pin['revision']}{locked}"))
    rows.append(("mechanisms", ", ".join(x["name"] for x in m["config"]["mechanisms"]) or "-"))
    rows.append(("overlays", ", ".join(o["name"] for o in m["inputs"]["overlays"]) or "-"))
    rows.append(("size", f"{len(files)} files, {sum(f['size'] for f in files):,} bytes"))
    base = m.get("base", {})
    if "dropped_files" in base:
        rows.append(
            (
                "pruned",
                f"kept {base['kept_files']} files / {base['kept_bytes']:,} bytes, dropped "
                f"{base['dropped_files']} files / {base['dropped_bytes']:,} bytes",
            )
        )
    for key, value in rows:
        table.add_row(f"[bold]{key}[/]", value)
    console().print(table)
    return 0


def _runtime_line(rt: dict) -> str:
    if rt["kind"] == "wheel":
        return f"{rt['name']} {rt['version']} ({rt['filename']}, sha256 {rt['sha256']})"
    return f"{rt['name']} (in-repo {rt['dir']}, {rt['digest']})"


def _engine_ls(args) -> int:
    from rich.table import Table

    from specpilot_build.store.engines import scan_store

    table = Table("engine", "setting", "arm", "files", "bytes")
    full = not sys.stdout.isatty()  # a pipe or a file gets whole ids
    engines, damaged = scan_store()
    for engine in engines:
        m = engine.manifest
        table.add_row(
            engine.id if full else engine.id[:12],
            m["setting"],
            m["arm"],
            str(len(m["files"])),
            f"{sum(f['size'] for f in m['files']):,}",
        )
    for bad in damaged:
        table.add_row(bad.id if full else bad.id[:12], f"[red]damaged[/]: {bad.reason}", "-", "-", "-")
    console().print(table)
    if damaged:
        print(
            f"{len(damaged)} damaged engine director{'y' if len(damaged) == 1 else 'ies'}: "
            f"`specpilot engine rm <id>` removes one"
        )
    return 0


def _sweep(args) -> int:
    from specpilot_build.cli.sweep import run_sweep

    run_sweep(args.settings, args.arms, args.launcher, args.overrides)
    return 0


def _tune(args) -> int:
    from specpilot_build.tune.run import tune

    tune(
        args.setting,
        args.space,
        args.trials,
        args.sampler,
        args.seed,
        args.study,
        args.limit,
        args.max_new_tokens,
        args.datasets.split(",") if args.datasets else None,
        args.port,
        args.timeout,
        promote=args.promote,
        eval_limit=args.eval_limit,
        leaders=args.leaders,
        launcher=args.launcher,
    )
    return 0


def _diff(args) -> int:
    import json

    from specpilot_build.store.diff import diff_engines, render
    from specpilot_build.store.engines import resolve_engine

    try:
        report = diff_engines(resolve_engine(args.a), resolve_engine(args.b), with_file_diffs=args.files)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecPilotError(f"cannot read the engines' manifests: {exc}") from None
    print(json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) if args.json else render(report))
    return 0 if report["identical"] else 1


# --- pins ----------------------------------------------------------------------------------------------------


def _env_lock(args) -> int:
    from specpilot_build.hosts.profiles import load_env_lock, load_host_profile
    from specpilot_build.hosts.resolve import resolve_env_lock, write_env_lock
    from specpilot_build.pins.lockfile import WheelPin, load_lock

    pin = load_lock().runtimes.get(args.runtime)
    if not isinstance(pin, WheelPin):
        raise SpecPilotError(f"runtime '{args.runtime}' is not a wheel runtime of lockfiles/runtimes.toml")
    path = write_env_lock(resolve_env_lock(args.runtime, pin, load_host_profile(args.host)))
    lock = load_env_lock(args.runtime, args.host)
    print(
        f"{len(lock.wheels)} wheels travel ({sum(w.size for w in lock.wheels) / 2**20:.1f} MiB), "
        f"{len(lock.staying)} stay on the host: {', '.join(f'{k} {v}' for k, v in lock.staying.items())}"
    )
    print(f"wrote {path}")
    return 0


def _env_host_profile(args) -> int:
    from specpilot_build.hosts.profiles import load_host_profile
    from specpilot_build.hosts.resolve import write_host_profile

    path = write_host_profile(args.host, args.freeze, args.python, args.glibc, args.cuda)
    profile = load_host_profile(args.host)
    print(f"{len(profile.packages)} packages, profile {profile.digest}; wrote {path}")
    return 0


def _env_install(args) -> int:
    from specpilot_build.assemble.inputs import resolve_inputs
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.hosts.install import install_environment, native_rules
    from specpilot_build.hosts.profiles import load_env_lock
    from specpilot_build.pins.lockfile import load_lock

    inputs = resolve_inputs(compose_setting(args.setting, args.arm, list(args.overrides)), load_lock())
    if inputs.environment is None:
        raise SpecPilotError(
            f"{args.setting}: not an SGLang setting on hardware with a host profile; it has no environment to install"
        )
    if os.path.lexists(args.target):
        raise SpecPilotError(f"{args.target} exists; give a new directory")
    lock = load_env_lock(inputs.runtime.name, inputs.environment["host"])
    record = install_environment(lock, native_rules(inputs.config), inputs.config, args.target)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(
        f"{len(record['wheels'])} wheels ({mib(inputs.environment['wheel_bytes'])} fetched), "
        f"{len(record['dropped_distributions'])} distributions left out; {len(record['kept'])} files "
        f"kept ({mib(record['kept_bytes'])}), {len(record['dropped'])} dropped ({mib(record['dropped_bytes'])}) "
        f"into {args.target}"
    )
    return 0


def _lock(args) -> int:
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.locations import lockfiles_dir
    from specpilot_build.models.checkpoints import checkpoint_requests
    from specpilot_build.models.lock import lock_repos

    requests = checkpoint_requests(compose_setting(args.setting).config)
    lockfile = lockfiles_dir() / "checkpoints.toml"
    locked = lock_repos(
        {r.repo: list(r.files) for r in requests},
        lockfile,
        update=args.update,
        source_formats={r.repo: r.source_format for r in requests},
    )
    for repo, pin in locked.items():
        converted = f", {len(pin.converted)} converted" if pin.converted else ""
        print(f"{repo}@{pin.revision}  {len(pin.files)} files{converted}")
    print(f"wrote {lockfile}")
    return 0


def _models(args) -> int:
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.models.checkpoints import materialize_setting
    from specpilot_build.pins.lockfile import load_lock

    config = effective_config(compose_setting(args.setting).config)  # the final arm's drafter, mechanisms applied
    pins = load_lock().checkpoints
    for role, path in materialize_setting(config, pins, mirror=args.mirror).items():
        repo = config[role].get("repo")
        if repo is None:  # a drafter `make draft` made: named by its lock key, found by its id
            made_for = config[role].get("made_for") or config["model"]["name"]
            print(f"{role:8} {made_for}-{config[role]['recipe']}  {path}")
            continue
        print(f"{role:8} {repo}@{pins[repo].revision[:12]}  {path}")
    return 0


def _draft(args) -> int:
    from specpilot_build.draft.make import make_drafter, recipe_of_setting
    from specpilot_build.draft.recipe import load_recipe

    recipe = load_recipe(args.recipe or recipe_of_setting(args.setting), args.overrides)
    if recipe["kind"] == "corpus":  # recipe (d): tokens, no training (draft/corpus.py)
        from specpilot_build.draft.corpus import make_corpus

        made = make_corpus(args.setting, recipe)
    else:
        made = make_drafter(args.setting, args.recipe, args.overrides)
    loss = f"  final loss {made.final_loss:.4f}" if made.final_loss is not None else ""
    how = f"made in {made.seconds:.1f} s" if made.built else "already in the store"
    print(f"drafter {made.name}  {made.id}  {how}{loss}")
    print(f"  {made.directory}")
    print(f"  pinned in lockfiles/drafters.toml [{made.name}]")
    return 0


def _draft_import(args) -> int:
    from specpilot_build.draft.carry import admit

    admitted = admit(args.bundle, args.overrides)
    print(f"drafter {admitted.name}  {admitted.id}  imported, its id recomputed here")
    print(f"  {admitted.directory}")
    print(f"  pinned in lockfiles/drafters.toml [{admitted.name}]")
    return 0


# --- run -----------------------------------------------------------------------------------------------------


def _serve(args) -> int:
    from specpilot_build.serve.process import serve

    engine = _engine_of(args.engine, args.setting, args.arm)
    serve(engine, args.port, args.gpu, ignore_hardware=args.ignore_hardware, dry_run=args.dry_run, timeout=args.timeout)
    return 0


def _engine_of(engine_ref: str | None, setting: str | None, arm: str):
    """The engine named by id, or a setting's engine built (or found) first: the one place a setting is built
    on the way to running something."""
    if setting:
        from specpilot_build.assemble.builder import build_engine

        return build_engine(setting, arm).engine
    from specpilot_build.store.engines import resolve_engine, scan_store

    if engine_ref is None:
        raise SpecPilotError("name an engine (id or unique prefix) or a --setting to build")
    ref = engine_ref.strip().lower()
    if len(ref) >= 4 and all(c in "0123456789abcdef" for c in ref) and scan_store(prefix=ref) == ([], []):
        pulled = _substitute_engine(ref)
        if pulled is not None:
            return pulled
    return resolve_engine(engine_ref)


def _substitute_engine(ref: str):
    """An engine id the store lacks, pulled from the first configured substituter that has it (None when no
    substituter is configured, or none holds it). A refused pull is an error: the id was asked for exactly."""
    from specpilot_build.cache.pull import pull_engine
    from specpilot_build.cache.remote import BinaryCache
    from specpilot_build.cache.settings import cache_settings
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.store.engines import store_root

    settings = cache_settings(compose_setting(DEFAULT_SETTING, "final").config)
    for url in settings.substituters:
        cache = BinaryCache(url)
        held = (
            cache.exists(f"manifests/{ref}.json")
            if len(ref) == 64
            else any(n.startswith(ref) for n in cache.names("manifests"))
        )
        if not held:
            print(f"substituter {url}: miss (no engine {ref})", file=sys.stderr)
            continue
        result = pull_engine(cache, ref, settings.trusted, store_root())
        print(result.summary(cache), file=sys.stderr)
        return result.engine
    return None


def _stop(args) -> int:
    from specpilot_build.serve.process import stop

    print(stop(args.port))
    return 0


def _bundle(args) -> int:
    import shutil

    from specpilot_build.store.engines import resolve_engine

    if not args.part_mb > 0:
        raise SpecPilotError(f"--part-mb {args.part_mb}: must be more than 0")
    if args.host is not None and args.env is not None:
        raise SpecPilotError("bundle: give --host (its environment is built from the lock) or --env DIR, not both")
    if args.trust and not args.cache:
        raise SpecPilotError("bundle: --trust applies to engines taken from a cache; pass --cache URL too")
    scratch = None
    try:
        if args.cache:
            engines, scratch = _bundle_engines_from_cache(args)
        else:
            engines = [resolve_engine(ref) for ref in args.engines]
        return _bundle_engines(args, engines)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _bundle_engines_from_cache(args):
    """(the engines args names, pulled from --cache into a scratch store and verified; that scratch folder)."""
    import shutil

    from specpilot_build.bundle.caches import pull_for_bundle, scratch_dir
    from specpilot_build.cache.progress import meter_for
    from specpilot_build.cache.remote import BinaryCache
    from specpilot_build.cache.settings import cache_settings
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.locations import data_dir

    settings = cache_settings(compose_setting(DEFAULT_SETTING, "final").config, args.trust)
    cache = BinaryCache(args.cache)
    scratch = scratch_dir(data_dir(), "bundle-pull")
    try:
        engines = pull_for_bundle(cache, args.engines, settings.trusted, scratch, meter_for(args.progress))
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    print(f"pulled {len(engines)} engine(s) from {cache} into {scratch} (verified)", file=sys.stderr)
    return engines, scratch


def _bundle_engines(args, engines) -> int:
    import tempfile
    import time

    from specpilot_build.bundle.pack import make_bundle
    from specpilot_build.cache.progress import meter_for

    start = time.monotonic()
    recorded = {(e.manifest["inputs"].get("environment") or {}).get("host") for e in engines}
    host = args.host
    if host is None and args.env is None and recorded - {None}:
        if len(recorded) > 1:
            raise SpecPilotError(
                f"bundle: these engines were built for different hosts "
                f"({', '.join(sorted(map(str, recorded)))}); bundle them separately"
            )
        host = recorded.pop()  # the host the engines were built for (their manifests' inputs.environment)
    with tempfile.TemporaryDirectory(prefix="bundle-env-") as scratch:
        env_dir, env_files = args.env, None
        if host is not None:
            env_dir, env_files = _host_environment(engines, host, Path(scratch))
        result = make_bundle(
            engines,
            part_bytes=int(args.part_mb * 2**20),
            env_dir=env_dir,
            env_files=env_files,
            host=host,
            out=args.out,
            meter=meter_for(args.progress),
        )
    archive = result.index["archive"]
    print(f"{archive['id']}  {result.path}")
    print(
        f"{archive['size']:,} bytes in {len(result.index['parts'])} part(s) of at most {archive['part_bytes']:,} "
        f"bytes, {time.monotonic() - start:.1f} s; on the host: python3 {result.path}/install.py "
        f"{result.path} PREFIX"
    )
    return 0


def _host_environment(engines, host: str, target: Path) -> tuple[Path, dict[str, str]]:
    """The engines' environment on `host`: the runtime's environment lock for that host, installed and pruned
    by the runtime's native rules into `target`; returns (target, kept path -> blake3). The engines must share
    one runtime and the same applicable rules (else bundle them separately)."""
    try:
        from specpilot_build.config.effective import rule_applies
        from specpilot_build.hosts.install import install_environment, native_rules
        from specpilot_build.hosts.profiles import load_env_lock
    except ImportError as exc:
        raise SpecPilotError(
            f"--host {host}: environment locks are not available in this checkout ({exc}); "
            "pass an installed environment directory with --env DIR"
        ) from None
    configs = [e.config for e in engines]
    runtimes = {cfg["runtime"]["name"] for cfg in configs}
    applied = {tuple(r["why"] for r in native_rules(cfg) if rule_applies(r, cfg)) for cfg in configs}
    if len(runtimes) != 1 or len(applied) != 1:
        raise SpecPilotError(
            f"bundle --host {host}: these engines need different environments (runtimes "
            f"{', '.join(sorted(runtimes))}); bundle them separately"
        )
    lock = load_env_lock(runtimes.pop(), host)
    for engine in engines:
        built = engine.manifest["inputs"].get("environment")
        if built is not None and (built.get("host") != host or built.get("digest") != lock.digest):
            raise SpecPilotError(
                f"engine {engine.id[:12]} was built for host {built.get('host')} with environment "
                f"lock {built.get('digest', '?')[:19]}…, not {host} with {lock.digest[:19]}… "
                f"({lock.path.name}); rebuild it or bundle for its host"
            )
    record = install_environment(lock, native_rules(configs[0]), configs[0], target)
    return target, {f["path"]: f["blake3"] for f in record["kept"]}


# --- measure -------------------------------------------------------------------------------------------------


def _bench(args) -> int:
    import json

    from specpilot_build.measure.bench import bench
    from specpilot_build.store.engines import resolve_engine

    engine = resolve_engine(args.engine)
    path = bench(
        engine,
        args.run,
        args.limit,
        args.max_new_tokens,
        args.port,
        args.datasets.split(",") if args.datasets else None,
        overwrite=args.overwrite,
        oracle_engine_id=_oracle_of(engine, args.oracle).id,
        split=args.split,
    )
    data = json.loads(path.read_text())
    skipped = f", {len(data['skipped'])} prompts skipped (too long)" if data.get("skipped") else ""
    print(
        f"wrote {path}: {len(data['requests'])} requests{skipped}, {data['wall_s']:.1f} s, client overhead "
        f"{data['client']['overhead_fraction']:.3%} of slot time; oracle {data['oracle_engine_id'][:12]}"
    )
    return 0


def _oracle_of(engine, named: str | None = None):
    """The oracle of a bench run: the engine's setting's `ar` engine — `named` (an id in the store, checked to be
    that setting's ar arm), or built (or found) from the same conf/ and lockfiles/ the engine was built from; an
    ar engine is its own."""
    setting = engine.manifest.get("setting")
    if engine.manifest.get("arm") == "ar":
        if named and not engine.id.startswith(named):
            raise SpecPilotError(f"engine {engine.id[:12]} is an ar arm: it is its own oracle, not {named}")
        return engine
    if not setting:
        raise SpecPilotError(f"engine {engine.id[:12]} names no setting: cannot build its ar oracle")
    if named:
        from specpilot_build.store.engines import resolve_engine

        oracle = resolve_engine(named)
        if (oracle.manifest.get("setting"), oracle.manifest.get("arm")) != (setting, "ar"):
            raise SpecPilotError(
                f"--oracle {oracle.id[:12]} is {oracle.manifest.get('setting')}/"
                f"{oracle.manifest.get('arm')}, not the ar arm of {setting}"
            )
    else:
        oracle = _build_ar(setting, "--oracle")
    if dict(oracle.model_pin) != dict(engine.model_pin):
        raise SpecPilotError(
            f"the ar engine {oracle.id[:12]} of setting {setting} serves target "
            f"{oracle.model_pin['repo']}@{oracle.model_pin['revision'][:12]}, engine "
            f"{engine.id[:12]} {engine.model_pin['repo']}@{engine.model_pin['revision'][:12]}: "
            "rebuild the engine from this checkout's pins"
        )
    return oracle


def _build_ar(setting: str, flag: str):
    """The setting's ar engine built (or found) from this checkout; where the builder's packages are missing (an
    installed bundle ships only what serving and measuring need) an error naming the flag that names it by id."""
    try:
        from specpilot_build.assemble.builder import build_engine

        return build_engine(setting, "ar").engine
    except ModuleNotFoundError as exc:
        from specpilot_build.store.engines import list_engines

        ars = [
            e.id[:12] for e in list_engines() if (e.manifest.get("setting"), e.manifest.get("arm")) == (setting, "ar")
        ]
        raise SpecPilotError(
            f"cannot build the ar engine of {setting} here: no module named '{exc.name}' (the "
            f"builder is not installed, e.g. on a host with an installed bundle); pass {flag} "
            f"{ars[0] if len(ars) == 1 else '<its ar engine id>'}"
        ) from None


def _compare(args) -> int:
    from specpilot_build.measure.compare import compare

    report = compare(args.ar, args.stock, args.final, name=args.report, overwrite=args.overwrite)
    print(f"wrote {report['json']}, {report['chart']} and {report['statement']}")
    return 0


def _attest_check(args) -> int:
    from specpilot_build.measure.attest import check_statement

    statement, problems = check_statement(args.statement)
    for line in problems:
        print(f"{args.statement}: {line}")
    if problems:
        print(f"{args.statement}: {len(problems)} problem(s): the attested files changed")
        return 1
    print(f"{args.statement}: {len(statement['subject'])} subjects match ({statement['predicateType']})")
    return 0


def _gaps(args) -> int:
    from specpilot_build.measure.gaps import gaps_report, print_report, write_report
    from specpilot_build.measure.results import load_results
    from specpilot_build.store.engines import resolve_engine

    report = gaps_report(resolve_engine(args.engine), args.run)
    path, _ = load_results(args.run)
    json_path, png_path = write_report(report, path.with_name(f"gaps_{path.stem}"))
    print_report(report)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _score(args) -> int:
    from specpilot_build.measure import sandbox
    from specpilot_build.measure.score import print_table, score_run

    score = score_run(
        args.run, workers=args.workers, limits=sandbox.Limits(cpu_s=args.cpu_seconds, wall_s=args.wall_seconds)
    )
    print_table(score)
    print(f"wrote {score['path']}")
    return 0


def _verify(args) -> int:
    from specpilot_build.measure.verify import exit_status, verify

    oracle = args.oracle or _default_oracle(args.run)
    report = verify(args.run, oracle, args.port, tolerance=args.tolerance, concurrency=args.concurrency)
    return exit_status(report)


def _default_oracle(run: str):
    """The run's recorded oracle: the engine of that id from the store, else built from this checkout's conf/
    and lockfiles/ only if the build gives exactly that id; otherwise an error naming what differs."""
    from specpilot_build.measure.results import load_results, require_current
    from specpilot_build.store.diff import diff_engines
    from specpilot_build.store.engines import Engine, list_engines

    path, data = load_results(run)
    require_current(path, data)
    recorded = data.get("oracle_engine_id")
    if not recorded:
        raise SpecPilotError(f"{path} records no oracle engine id; pass ORACLE=<engine id>")
    found = [e for e in list_engines() if e.id == recorded]
    if found:
        return found[0]
    if not data.get("setting"):
        raise SpecPilotError(
            f"{path} names no setting and its oracle {recorded[:12]} is not in the store; pass ORACLE=<engine id>"
        )
    built = _build_ar(data["setting"], "--oracle")
    if built.id == recorded:
        return built
    manifest = (data.get("oracle") or {}).get("manifest")
    if manifest:
        recorded_engine = Engine(recorded, path.parent / f".absent-{recorded}")  # no tree: its recorded manifest
        recorded_engine.__dict__["manifest"] = manifest
        why = diff_engines(recorded_engine, built)["why"]
    else:
        why = ["the run records no oracle manifest to diff"]
    raise SpecPilotError(
        f"{path}: its oracle is engine {recorded[:12]}, which is not in the store, and building "
        f"the {data['setting']} ar engine from this checkout gives {built.id[:12]}; what differs "
        f"(recorded → built): " + "; ".join(why)
    )


def _demo(args) -> int:
    from specpilot_build.cli.demo import demo

    result = demo(
        args.setting,
        args.limit,
        args.max_new_tokens,
        args.port,
        args.datasets.split(",") if args.datasets else None,
        repeat=args.repeat,
    )
    return 0 if result["verify"]["real_mismatches"] == 0 else 1
