"""``fedforge client`` (one factory: edge agent + SuperNode) and ``fedforge agent`` (agent only)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import click

from client.config import DEFAULT_CLASSES, AgentConfig
from common.clip import CLIP_NORM, DEFAULT_CLIP_NORM
from common.procs import ProcessSet, free_port, keep_running, supernode_command, supernode_env

log = logging.getLogger("fedforge.client")
STABLE_SECONDS = 60.0  # a SuperNode that ran this long had connected: its next exit starts the backoff afresh
MAX_RESTART_DELAY = 8  # seconds between SuperNode restarts, at most


factory_id_option = click.option("--factory-id", required=True, help="This factory's name, as the server and dashboard show it.")


def agent_options(f):  # type: ignore[no-untyped-def]
    options = [
        factory_id_option,
        click.option("--agent-listen", default="127.0.0.1:50061", help="Where the agent serves its training control plane (Train, SecAgg, "
                     "Evaluate, Proxy) to the SuperNode: a loopback host:port or unix:/path, never the network."),
        click.option("--data", default="synthetic", help="'synthetic' or an image folder with one sub-folder per class (any format Pillow reads); "
                     "indexed again when a run starts, so images copied in are trained on from the next run."),
        click.option("--classes", default=DEFAULT_CLASSES, help="Comma-separated class names this factory's folders may be named after "
                     "(the federation's class list); an unknown folder name is refused at start."),
        click.option("--class-alias", "class_alias", multiple=True, help="FOLDER=CLASS: a folder that holds a class under another name, "
                     "e.g. --class-alias good=ok (repeatable)."),
        click.option("--memory-limit-mb", default=2048, type=click.IntRange(0), help="Decoded images kept in memory; a larger folder is "
                     "streamed from disk batch by batch."),
        click.option("--bit-depth", default=16, type=click.IntRange(8, 16), help="Significant bits of this factory's 16-bit grey images and "
                     "colour TIFFs: 12 for a camera that writes Mono12 (or 12-bit RGB) as 0..4095 (read as 16 bits such images are dark). Training and Inspection "
                     "read them alike; a pixel above the range makes the file unreadable, by name."),
        click.option("--share-metrics/--no-share-metrics", default=False, help="Send this factory's own figures (held-out accuracy, loss) "
                     "to the central site; without it only federation-wide sums leave the factory."),
        click.option("--require-secure-aggregation/--no-require-secure-aggregation", default=True,
                     help="Refuse every request whose answer would leave this factory in plaintext (weights, predictions, figures): "
                          "only masked contributions to a secure sum leave it."),
        click.option("--secagg-min-cohort", default=3, type=click.IntRange(3), help="Refuse secure-aggregation sessions with fewer share holders."),
        click.option("--secagg-colluders", default=0, type=click.IntRange(0), help="Colluding factories to tolerate: a session's threshold must "
                     "exceed half its size plus this."),
        click.option("--personalize/--no-personalize", default=True, help="Keep a personal model (the approved model fine-tuned on this "
                     "factory's images, blended with a head trained on them alone); Inspection serves it unless the approved model "
                     "validates clearly better on the held-out split."),
        click.option("--factory-index", default=0, type=int, help="Synthetic data: which partition this factory holds."),
        click.option("--num-factories", default=3, type=int, help="Synthetic data: number of partitions."),
        click.option("--data-seed", default=0, type=int, help="Synthetic data: seed."),
        click.option("--alpha", default=1.0, type=float, help="Synthetic data: Dirichlet label skew (smaller = more skewed)."),
        click.option("--train-size", default=600, type=int, help="Synthetic data: images in this factory."),
        click.option("--architecture", default="", help="The model this factory trains (e.g. cnn-small on a weak box, cnn-medium on a GPU node); "
                     "factories with different architectures are averaged within their group and share knowledge by distillation. "
                     "Empty: whatever the server's run config says."),
        click.option("--torch-threads", default=1, type=int, help="torch intra-op threads for training."),
        click.option("--feature-device", default="auto", help="Where the frozen pretrained backbone computes this factory's image "
                     "features (once per image, then cached): auto (a GPU if torch sees one, else the CPU), cpu, cuda or cuda:N."),
        click.option("--parallelism", default="none", type=click.Choice(["none", "ddp", "fsdp"]), help="Local training across several workers."),
        click.option("--local-world-size", default=1, type=click.IntRange(1), help="Ranks of the DDP/FSDP worker group (GPUs or CPU workers)."),
        click.option("--registry", default="", help="Central ModelRegistry (host:port): follow approvals and serve Inspection."),
        click.option("--registry-public-key", default="", help="The central site's signing.pub, pinned: unverifiable models are never loaded."),
        click.option("--release-public-key", default="", help="The federation's release.pub, pinned: only versions with an approval signed "
                     "by it are served, never an older release without a signed rollback."),
        click.option("--registry-token", default="", envvar="FEDFORGE_REGISTRY_TOKEN", help="The registry's client token "
                     "(the central site's registry/keys/registry.token)."),
        click.option("--inspection-listen", default="127.0.0.1:50062", help="Where inspection stations call Inspection (with --registry), "
                     "apart from the control plane; off loopback only with --inspection-token and TLS."),
        click.option("--inspection-token", default="", envvar="FEDFORGE_INSPECTION_TOKEN", help="Token every Inspection call must carry "
                     "('authorization: Bearer <token>'); required off loopback."),
        click.option("--inspection-tls-cert", default="", help="PEM certificate for Inspection over TLS (required off loopback)."),
        click.option("--inspection-tls-key", default="", help="PEM private key of --inspection-tls-cert."),
        click.option("--state-dir", default="fedforge-factory", type=click.Path(file_okay=False), help="Durable factory state (privacy ledger)."),
        click.option("--dp/--no-dp", default=False, help="Train with DP-SGD (Opacus) under this factory's privacy budget."),
        click.option("--dp-epsilon", default=8.0, type=float, help="Privacy budget epsilon_max over all rounds and runs."),
        click.option("--dp-delta", default=1e-5, type=float, help="Privacy budget delta."),
        click.option("--dp-max-grad-norm", default=DEFAULT_CLIP_NORM, type=CLIP_NORM, help="Per-sample gradient clipping bound, or "
                     "public: with --dp-secure-sum in a public subspace, a fifth of the public proxy images' feature norm there, else 1.0."),
        click.option("--dp-planned-rounds", default=20, type=int, help="Rounds the budget is planned for (sets the noise)."),
        click.option("--dp-grad-sample-mode", default="hooks", type=click.Choice(["hooks", "ew", "functorch", "ghost"]), help="Opacus per-sample gradient mode."),
        click.option("--dp-fix-model/--no-dp-fix-model", default=False, help="Replace BatchNorm by GroupNorm instead of refusing the model."),
        click.option("--dp-secure-sum/--no-dp-secure-sum", default=False, help="Share the DP noise of the secure sum: one full-batch DP step "
                     "per round, adding 1/(threshold - secagg-colluders) of the noise variance; epsilon then holds against whoever sees "
                     "only sums, if at most --secagg-colluders factories of a session collude or add no noise (docs/security.md). "
                     "Outside a secure sum the factory adds all of it."),
        click.option("--dp-count-noise", default=4.0, type=float, help="Noise multiplier of the one Gaussian release of the training "
                     "class counts, the only counts a DP factory sends (its update's weight, its distillation weights); charged once, "
                     "kept in the ledger and reused; the DP-SGD noise is planned with it inside --dp-epsilon."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _agent_config(kw: dict) -> AgentConfig:
    """The agent's typed configuration from the command's options (every option is a field of the same name)."""
    fields = {("listen" if k == "agent_listen" else k): v for k, v in kw.items()}
    fields["class_alias"] = tuple(fields.get("class_alias") or ())
    try:
        return AgentConfig(**fields).validated()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _start_agent(cfg: AgentConfig):  # type: ignore[no-untyped-def]
    from client.agent import serve
    from common.data.folder import DatasetError

    try:
        return serve(cfg)
    except DatasetError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command()
@agent_options
def agent(**kw: object) -> None:
    """Run only the edge agent (the SuperNode is started elsewhere)."""
    running = _start_agent(_agent_config(kw))
    try:
        running.wait()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()


def supernode_options(f):  # type: ignore[no-untyped-def]
    options = [
        click.option("--superlink", default="127.0.0.1:8000", help="The central SuperLink's address."),
        click.option("--supernode-port", default=9094, type=click.IntRange(0, 65535),
                     help="Local port of this SuperNode's runtime API (one per host); 0 picks a free one at every (re)start."),
        click.option("--workdir", default="fedforge-factory", type=click.Path(file_okay=False), help="Logs of the SuperNode."),
        click.option("--insecure/--tls", default=True, help="Plain HTTP to the SuperLink (loopback demos only) or TLS."),
        click.option("--root-certificates", default=None, type=click.Path(dir_okay=False, exists=True), help="The federation's CA (ca.pem) for TLS."),
        click.option("--auth-key", default=None, type=click.Path(dir_okay=False, exists=True), help="This factory's registered authentication key."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def run_supernode(factory_id: str, agent_address: str, superlink: str, supernode_port: int, workdir: str, insecure: bool,
                  root_certificates: str | None, auth_key: str | None) -> None:
    """Flower's SuperNode (with FedForge's patches, `client.supernode`) forwarding to the agent at ``agent_address``,
    restarted whenever it exits, until Ctrl-C."""
    node_config = f"factory-id='{factory_id}' agent-address='{agent_address}'"
    cmd = [*supernode_command(), "--superlink", superlink, "--node-config", node_config]
    if insecure:
        cmd.append("--insecure")
    elif not root_certificates:
        raise click.UsageError("--tls needs --root-certificates (the federation's ca.pem)")
    else:
        cmd += ["--root-certificates", str(Path(root_certificates).resolve())]
    if auth_key:
        cmd += ["--auth-supernode-private-key", str(Path(auth_key).resolve())]

    def command() -> list[str]:  # --supernode-port 0: a port free at this (re)start, not one that was free earlier
        return [*cmd, "--port", str(supernode_port or free_port())]

    with ProcessSet(Path(workdir) / "logs") as procs:
        try:
            # After a crash the SuperLink refuses the same (authenticated) node until its heartbeat lapses
            # (up to 60 s in Flower 1.42), so keep retrying every few seconds rather than backing off further.
            keep_running(procs, "supernode", command, f"factory {factory_id}: SuperNode", env=supernode_env(), max_delay=MAX_RESTART_DELAY,
                         stable_seconds=STABLE_SECONDS,
                         on_start=lambda proc: log.info("factory %s: SuperNode pid %d dialling %s", factory_id, proc.pid, superlink))
        except KeyboardInterrupt:
            log.info("factory %s: stopping", factory_id)


@click.command()
@agent_options
@supernode_options
def client(superlink: str, supernode_port: int, workdir: str, insecure: bool, root_certificates: str | None, auth_key: str | None, **kw: object) -> None:
    """Run one factory: the warm edge agent plus a Flower SuperNode that forwards to it."""
    cfg = _agent_config(kw)
    if cfg.registry and not insecure and not cfg.registry_ca:
        cfg = replace(cfg, registry_ca=str(Path(root_certificates).resolve()) if root_certificates else "")
    running = _start_agent(cfg)
    try:
        run_supernode(cfg.factory_id, cfg.listen, superlink, supernode_port, workdir, insecure, root_certificates, auth_key)
    finally:
        running.stop()


@click.command()
@factory_id_option
@click.option("--agent-address", default="127.0.0.1:50061", help="The factory's agent (its --agent-listen): a loopback host:port or "
              "unix:/path to a socket shared with the agent's user or container.")
@supernode_options
def supernode(factory_id: str, agent_address: str, **kw: object) -> None:
    """Run only the factory's Flower SuperNode, forwarding every message to an agent that runs apart from it.

    The agent holds the images, the state and the policy; run it as another OS user, or in another container, with
    ``fedforge agent --agent-listen unix:/path`` and give this command only that socket (docs/operations.md)."""
    run_supernode(factory_id, agent_address, **kw)  # type: ignore[arg-type]
