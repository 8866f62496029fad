"""``fedforge demo``: a whole federation on this machine, started, run, summarised and stopped.

It starts the same commands an operator runs on real sites (``fedforge server`` and one
``fedforge client`` per factory, each with its SuperNode and warm edge agent), submits a run with
``flwr run``, follows the rounds through the registry, and stops every process it started, also on
Ctrl-C or failure.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from common.clip import CLIP_NORM, DEFAULT_CLIP_NORM
from common.procs import ProcessSet
from server import launch
from server.cli import parse_overrides
from server.local import LocalFederation
from server.registry.service import Registry

log = logging.getLogger("fedforge.demo")
console = Console(stderr=True)
GOOD_NAMES = ("ok", "good", "pass", "passed", "normal", "nominal", "no_defect", "defect-free")  # what --folders takes as the good parts


@click.command()
@click.option("--factories", default=3, type=click.IntRange(1, 64), help="Number of factories (SuperNode + agent each).")
@click.option("--rounds", default=None, type=click.IntRange(1), help="Server rounds (default: the run configuration's num-server-rounds).")
@click.option("--local-epochs", default=None, type=click.IntRange(0), help="Local epochs per round (default: the run configuration's).")
@click.option("--seed", default=0, type=int, help="Seed for data and model initialisation.")
@click.option("--workdir", default="fedforge-demo", type=click.Path(file_okay=False), help="Logs, SuperLink database and registry.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write a JSON summary here.")
@click.option("--architecture", default=None, help="Model architecture: effnet-lite0 (pretrained, frozen; the default), cnn-small, cnn-medium, cnn-large.")
@click.option("--folders", default=None, type=click.Path(exists=True, file_okay=False),
              help="Your own images instead of generated ones: ROOT/<factory>/train|test/<class>/ (or only ROOT/<factory>/<class>/), "
                   "optional ROOT/test (or central_test/, holdout/) and ROOT/proxy (or public/, unlabeled/) (the layout of bench/quality.py --folders; docs/operations.md). One factory per "
                   "folder; classes are the folder names.")
@click.option("--class-alias", "class_alias", multiple=True, metavar="FOLDER=CLASS",
              help="With --folders: a folder that holds a class under another name, at any factory (repeatable).")
@click.option("--train-size", default=600, type=click.IntRange(10), help="Synthetic images per factory.")
@click.option("--alpha", default=1.0, type=float, help="Dirichlet label skew across factories (smaller = more skewed).")
@click.option("--min-factories", default=None, type=click.IntRange(1), help="Abort a round below this many good updates (default: factories - 1, at least 1).")
@click.option("--round-timeout", default=300.0, type=float, help="Seconds to wait for factories in a round.")
@click.option("--lr", default=None, type=float, help="Local learning rate (default: the run configuration's).")
@click.option("--secure/--no-secure", default=True, help="Secure aggregation (SecAgg+): the server learns only the sum.")
@click.option("--dp/--no-dp", default=False, help="Factories train with DP-SGD under their own privacy budget.")
@click.option("--epsilon", default=8.0, type=float, help="With --dp: each factory's privacy budget epsilon_max.")
@click.option("--dp-secure-sum/--no-dp-secure-sum", default=False, help="With --dp: the factories share the secure sum's DP noise "
              "(one DP step per round, default rounds 30; docs/security.md says what it assumes).")
@click.option("--dp-max-grad-norm", default=DEFAULT_CLIP_NORM, type=CLIP_NORM, help="With --dp: the factories' per-example clipping norm, or "
              "public: with --dp-secure-sum, a fifth of the public proxy images' feature norm, else 1.0 (docs/operations.md).")
@click.option("--dashboard-port", default=0, type=int, help="Dashboard port (0: a free one); its URL is printed.")
@click.option("--admin-token", default=None, envvar="FEDFORGE_ADMIN_TOKEN", help="Dashboard admin token (default: a random one, printed).")
@click.option("--parallelism", default="none", type=click.Choice(["none", "ddp", "fsdp"]), help="Local training in a DDP/FSDP worker group.")
@click.option("--local-world-size", default=1, type=click.IntRange(1), help="Ranks per factory with --parallelism ddp|fsdp.")
@click.option("--distill", default="off", type=click.Choice(["off", "after", "only"]), is_flag=False, flag_value="after",
              help="Ensemble distillation on a proxy set: after FedAvg every round (--distill, = after), or only distillation "
                   "(factories send predictions, never weights).")
@click.option("--architectures", default="", help="Comma-separated architecture per factory, cycled (e.g. cnn-small,cnn-medium): "
              "each architecture is its own group and line of versions; distillation transfers across groups.")
@click.option("--set", "overrides", multiple=True, help="Any other run-config key, e.g. --set distill-epochs=10 (repeatable).")
def demo(factories: int, rounds: int, local_epochs: int, seed: int, workdir: str, json_path: str | None, architecture: str,
         folders: str | None, class_alias: tuple[str, ...], train_size: int, alpha: float, min_factories: int | None, round_timeout: float, lr: float, secure: bool, dp: bool, epsilon: float,
         dp_secure_sum: bool, dp_max_grad_norm: float | str, parallelism: str, local_world_size: int, dashboard_port: int, admin_token: str | None, distill: str, architectures: str,
         overrides: tuple[str, ...]) -> None:
    """Run a local demo federation over real Flower processes on 127.0.0.1."""
    archs = [a.strip() for a in architectures.split(",") if a.strip()]
    from common.models import ARCHITECTURES, natural_image_size
    from common.training import TrainConfig
    from server.config import SECURE_SUM_DP_ROUNDS, FederationConfig

    if dp_secure_sum and not (dp and secure):
        raise click.UsageError("--dp-secure-sum shares the noise of secure sums: it needs --dp and --secure")
    defaults = FederationConfig()  # the recipe's defaults, in one place (no torch import here)
    rounds = rounds or (SECURE_SUM_DP_ROUNDS if dp_secure_sum else defaults.num_server_rounds)
    architecture = architecture or defaults.architecture
    local_epochs = TrainConfig().epochs if local_epochs is None else local_epochs
    lr = lr or TrainConfig().lr

    if unknown := sorted(set(archs + [architecture]) - set(ARCHITECTURES)):
        raise click.BadParameter(f"unknown architecture(s) {unknown}; choose from {sorted(ARCHITECTURES)}", param_hint="--architectures")
    t_start = time.perf_counter()
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    run_config: dict[str, Any] = {
        "round-timeout": round_timeout, "architecture": architecture, "local-epochs": local_epochs, "lr": lr, "secure-aggregation": secure,
        "distill": distill,
        **({"min-factories": min_factories} if min_factories else {}),
    }
    factory_args: dict[int, list[str]] = {}
    chosen = parse_overrides(overrides)
    if class_alias and not folders:
        raise click.UsageError("--class-alias maps folder names: it applies to --folders")
    if folders:
        ctx = click.get_current_context()
        if given := [f"--{name.replace('_', '-')}" for name in ("factories", "train_size", "alpha")
                     if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]:
            raise click.UsageError(f"{', '.join(given)}: the generated data's, not --folders' (one factory per folder, its own images)")
        factories, own_config, factory_args = own_folders(Path(folders), root, chosen, class_alias, dp)
        run_config |= own_config
    run_config |= chosen
    # one image size for every factory's model: the smallest of their architectures' own (a CNN factory is not made to
    # train on the pretrained backbone's 128 px)
    run_config.setdefault("image-size", natural_image_size(architecture, *archs))
    with ProcessSet(root / "logs") as procs:
        flags = ["--dp", "--dp-epsilon", str(epsilon), "--dp-planned-rounds", str(rounds), "--dp-max-grad-norm", str(dp_max_grad_norm)] if dp else []
        flags += ["--dp-secure-sum"] if dp_secure_sum else []
        flags += ["--parallelism", parallelism, "--local-world-size", str(local_world_size)]
        if not secure:  # the factories must agree to answer in plaintext: they require secure aggregation by default
            flags.append("--no-require-secure-aggregation")
        admin_token = admin_token or secrets.token_urlsafe(16)
        fed = LocalFederation(root, procs, num_factories=factories, seed=seed, alpha=alpha, train_size=train_size, factory_flags=flags,
                              dashboard_port=dashboard_port, admin_token=admin_token, architectures=archs, factory_args=factory_args)
        try:
            console.print(f"[bold]FedForge demo[/]: {factories} factories, {rounds} rounds, distillation {distill}, workdir {root}")
            fed.start_central()
            console.print(f"  dashboard: [bold]{fed.dashboard_url}[/]  (admin token for approvals: {admin_token})")
            for i in range(factories):
                fed.start_factory(i)
            # The ServerApp waits for the factories itself (expected-factories): submit while they start.
            flwr_run_id = fed.submit(fed.run_config(rounds, **run_config))
            console.print(f"  submitted Flower run {flwr_run_id}; logs in {root / 'logs'}")
            for f in fed.factories:
                health = fed.wait_for_agent(f.agent_address)
                console.print(f"  {f.factory_id}: agent pid {health.pid} serving {health.num_examples} images on {f.agent_address}"
                              f" ({health.architecture or architecture})")
            summary = follow_run(Registry.at(fed.registry_dir), f"run-{flwr_run_id}", rounds, fed.flwr_home(), flwr_run_id, procs)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; stopping every process[/]")
            raise SystemExit(130) from None
        except (RuntimeError, TimeoutError) as exc:
            console.print(f"[red]demo failed:[/] {exc}")
            raise SystemExit(1) from None
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    print_summary(summary)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    if summary["status"] != "finished":
        raise SystemExit(1)


def own_folders(path: Path, root: Path, chosen: dict[str, Any], aliases: tuple[str, ...] = (),
                dp: bool = False) -> tuple[int, dict[str, Any], dict[int, list[str]]]:
    """``--folders``: the number of factories, the run-config keys (class list, channels: RGB if any factory's images are in
    colour unless ``chosen``, the ``--set`` keys, name them; central test and proxy folders) and each factory's ``fedforge
    client`` flags (its training folder, the class list, the ``aliases``) of the federation under ``path``. With ``dp`` and
    no proxy folder (nor a ``proxy-data`` in ``chosen``) it says what DP loses."""
    from common.data.classes import format_classes, parse_aliases
    from common.data.layout import FolderFederation

    try:
        layout = FolderFederation.at(path, split_dir=root / "split", aliases=parse_aliases(aliases))
    except ValueError as exc:  # DatasetError, ClassListError: the message names the folder or the alias
        raise click.BadParameter(str(exc), param_hint="--folders") from None
    no_public = layout.no_public_images() if dp and "proxy-data" not in chosen else ""
    for line in (layout.describe_split(), layout.describe_ignored(), layout.case_clashes(), no_public):
        if line:
            console.print(f"  --folders: {line}")
    classes = format_classes(layout.classes)
    channels = chosen["channels"] if "channels" in chosen else layout.channels()  # images are decoded only when it is not set
    run_config = {"classes": classes, "test-data": str(layout.central_test_folder(root / "central-test")), "channels": channels,
                  **({"proxy-data": str(layout.proxy)} if layout.proxy else {})}
    good = [c for c in layout.classes if c.casefold() in GOOD_NAMES]
    if len(good) == 1:  # escape and false-reject rates need the class of good parts; --set good-class=... names another
        run_config["good-class"] = good[0]
    console.print(f"  {len(layout.factories)} factories from {path} ({', '.join(d.name for d in layout.factories)}), classes {list(layout.classes)}, "
                  f"read as {'RGB' if channels == 3 else 'grey'}, central test set {run_config['test-data']}, "
                  f"proxy set {layout.proxy or 'none'}")
    flags = ["--classes", classes, *layout.alias_flags()]
    if "data-bit-depth" in chosen:  # the folders' 16-bit grey images, as every site reads them (the factories' --bit-depth)
        flags += ["--bit-depth", str(chosen["data-bit-depth"])]
    return len(layout.factories), run_config, {i: ["--data", str(train), *flags] for i, train in enumerate(layout.trains)}


def follow_run(registry: Registry, run_id: str, rounds: int, home: Path, flwr_run_id: str, procs: ProcessSet,
               deadline: float | None = None) -> dict[str, Any]:
    """Show a progress bar as the registry records rounds; return the summary when the run ends (TimeoutError after
    ``deadline``, a ``time.monotonic()`` value)."""
    last_flwr_check = time.monotonic()
    with Progress(TextColumn("[bold]round {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("waiting for the first round", total=rounds)
        while True:
            run = registry.get_run(run_id)
            done = registry.rounds(run_id) if run else []
            if done:
                last = done[-1]
                if last.status != "completed":
                    acc = "aborted"
                elif last.accuracy is not None:
                    acc = f"accuracy {last.accuracy:.3f}"
                else:
                    acc = f"federated accuracy of the previous model {last.metrics.get('federated-accuracy', float('nan')):.3f}"
                progress.update(task, completed=len(done), description=f"{acc}, {len(last.participants)} factories, {last.seconds:.1f}s")
            if run is not None and run.status != "running":
                break
            if dead := procs.dead():
                raise RuntimeError(f"process {dead[0][0]} exited with {dead[0][1]} (see its log)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} has not ended in time")
            if time.monotonic() - last_flwr_check > 15:
                last_flwr_check = time.monotonic()
                status = launch.run_status(home, flwr_run_id)
                if status.startswith("finished") and (registry.get_run(run_id) is None or registry.get_run(run_id).status == "running"):
                    raise RuntimeError(f"Flower run {flwr_run_id} ended as {status} before FedForge recorded its end (see logs/central.log and the registry's server.log)")
            time.sleep(0.25)
    run = registry.get_run(run_id)
    versions = registry.versions(run_id)
    completed = [r for r in done if r.status == "completed"]
    final = registry.latest_evaluation(versions[-1].id) if versions else None
    return {
        "run_id": run_id,
        "flwr_run_id": flwr_run_id,
        "status": run.status,
        "error": run.error,
        "rounds": [
            {"round": r.server_round, "status": r.status, "accuracy": r.accuracy, "loss": r.loss, "participants": r.participants,
             "failures": r.failures, "seconds": round(r.seconds, 3), "reason": r.metrics.get("reason", ""),
             "federated_accuracy_before": r.metrics.get("federated-accuracy"), "escape_rate_before": r.metrics.get("federated-escape-rate"),
             "false_reject_rate_before": r.metrics.get("federated-false-reject-rate")}
            for r in done
        ],
        "final_federated": ({"accuracy": final.figures.get("accuracy"), "escape_rate": final.figures.get("escape-rate"),
                             "false_reject_rate": final.figures.get("false-reject-rate"), "recall": final.figures.get("recall"),
                             "images": final.examples, "factories": final.factories, "phase": final.phase, "version": final.version_id}
                            if final is not None else None),
        "initial_accuracy": versions[0].metrics.get("accuracy") if versions else None,
        "final_accuracy": completed[-1].accuracy if completed else None,
        "versions": [{"id": v.id, "round": v.server_round, "kind": v.kind, "architecture": v.architecture, "parent": v.parent_id,
                      "sha256": v.sha256, "privacy": v.privacy, "secure_aggregation": v.secure_aggregation}
                     for v in versions],
        "architectures": {
            arch: {"initial_accuracy": line[0].metrics.get("accuracy"), "final_accuracy": line[-1].metrics.get("accuracy"),
                   "versions": len(line), "distilled": sum(v.kind == "distilled" for v in line)}
            for arch in sorted({v.architecture for v in versions})
            for line in [[v for v in versions if v.architecture == arch]]
        },
        "registry": str(registry.artifacts.root.parent),
    }


def _f(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


def privacy_line(versions: list[dict[str, Any]]) -> str:
    """What each DP factory has spent of its budget by the last version (as the dashboard's privacy page says it), or ''
    when none trains with DP: a run that ends with its factories' budgets spent says so where the operator looks."""
    privacy = versions[-1].get("privacy") if versions else None
    if not privacy:
        return ""
    parts = []
    for factory, p in sorted(privacy.items()):
        part = f"{factory} ε {p['epsilon-spent']:.2f} of {p['epsilon-max']:.2f}"
        if p.get("dp-noise-holders"):
            part += f" (noise shared with {p['dp-noise-holders']:.0f} honest inputs; ε {p['epsilon-alone']:.2f} on its own noise)"
        parts.append(part)
    deltas = sorted({p["delta"] for p in privacy.values()})
    return f"privacy spent (δ {', '.join(f'{d:g}' for d in deltas)}): " + "; ".join(parts)


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"FedForge run {summary['run_id']} ({summary['status']})",
                  caption="test: the new model on the central test set; federated: the model each round started from, on the factories' "
                          "held-out images")
    for col in ("round", "status", "test accuracy", "federated", "escape", "factories", "failed", "seconds"):
        table.add_column(col, justify="right" if col not in ("status", "failed") else "left")
    for r in summary["rounds"]:
        table.add_row(str(r["round"]), r["status"], _f(r["accuracy"]), _f(r["federated_accuracy_before"]), _f(r["escape_rate_before"]),
                      str(len(r["participants"])), ", ".join(sorted(r["failures"])) or "-", f"{r['seconds']:.2f}")
    console.print(table)
    if final := summary.get("final_federated"):
        console.print(f"final model on {final['images']} held-out images at {final['factories']} factories: accuracy {_f(final['accuracy'])}, "
                      f"escape rate {_f(final['escape_rate'])}, false-reject rate {_f(final['false_reject_rate'])}")
    if len(summary.get("architectures", {})) > 1 or any(a["distilled"] for a in summary.get("architectures", {}).values()):
        for arch, a in summary["architectures"].items():
            console.print(f"  {arch}: accuracy {_f(a['initial_accuracy'])} -> {_f(a['final_accuracy'])} over {a['versions']} versions "
                          f"({a['distilled']} distilled)")
    if line := privacy_line(summary["versions"]):
        console.print(line)
    console.print(f"final accuracy {summary['final_accuracy']}, {len(summary['versions'])} versions in {summary['registry']}, "
                  f"wall time {summary['wall_seconds']:.1f}s")
    if summary["error"]:
        console.print(f"[red]error:[/] {summary['error']}")
    if summary["versions"]:
        registry, last = summary["registry"], summary["versions"][-1]["id"]
        console.print("next steps:")
        console.print(f"  fedforge models ls --registry-dir {registry}")
        console.print(f"  fedforge models approve {last} --registry-dir {registry}")
        console.print(f"  fedforge models export {last} --registry-dir {registry} --out {Path(registry).parent.parent / 'export'}")
