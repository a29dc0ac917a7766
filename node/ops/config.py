"""`murmur run`'s settings, defined once, and where they come from: flags > `MURMUR_*` environment > TOML file > defaults.

Each setting is one dataclass field: `NodeConfig` holds the node's, `RunOptions` the process's
(its logging and the config file), `Emulation` the slower hardware a test swarm on one machine
emulates. The field's `option(...)` gives its default, help and parsing;
`add_options` generates the `murmur run` parser from the fields (long option named like the field,
or `flag`; destination = the field name) and `run_settings` builds the dataclasses back from the
parsed namespace. A flag, its help, its `MURMUR_*` variable, its TOML key and its default therefore
come from one place; a field without `option` (e.g. `gossip_every`) is not on the command line.

Where the values come from (environment, `--config` file) is `config_sources`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

from murmur.node.learn.weight_average import DEFAULT_DECAY
from murmur.node.ops.logs import LOG_FORMATS, LOG_LEVELS
from murmur.protocol.messages import WIRE_DTYPE_NAMES

DEFAULT_DATA_DIR = Path.home() / ".murmur"
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
_OPTION = "option"  # the dataclass field metadata key
AUTO_RELAY = "auto"  # `--relay auto`: find relays among known peers (also the default without --relay)


@dataclass(frozen=True)
class Option:
    """How a dataclass field appears on the command line. The value type comes from the field's
    annotation (`float | None` → float; `list[str]` → a repeatable option; `bool` → a flag that
    sets the opposite of the default, so a field defaulting to true needs a negative `flag`)."""

    help: str
    flag: str | None = None  # long option name when not the field's (`relays` → `--relay`)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # argparse `type`, instead of the annotated type
    choices: Callable[[], Collection[str]] | None = None  # called when a parser is built (may import)
    names: Callable[[], Collection[str]] | None = None  # values `help` lists at "{names}", not the only ones allowed

    def help_text(self) -> str:
        """The help, with the values `names` gives listed (this may import what lists them)."""
        return self.help.format(names=", ".join(self.names())) if self.names is not None else self.help


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None, **how: Any) -> Any:
    """A dataclass field that is a `murmur run` option (see `Option` for `how`)."""
    metadata = {_OPTION: Option(help, **how)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# --- values that need more than their type; each imports what it checks with, when first used ---


def _device_syntax(spec: str) -> str:
    from murmur.node.learn.device import DeviceError, check_device_syntax

    try:
        return check_device_syntax(spec)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _announce_addr(text: str) -> str:
    import multiaddr

    try:
        multiaddr.Multiaddr(text)
    except Exception as exc:
        raise argparse.ArgumentTypeError(f"not a multiaddr: {text!r} ({exc})") from None
    if "/p2p-circuit" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is a relay circuit: use --relay <relay address> instead")
    return text


def _bootstrap_addr(text: str) -> str:
    import multiaddr
    from libp2p.peer.id import ID

    from murmur.node.net.membership import parse_bootstrap

    try:
        peer_id, _ = parse_bootstrap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        multiaddr.Multiaddr(text)
        ID.from_base58(peer_id)
    except Exception as exc:  # the libraries raise assorted types for bad input
        raise argparse.ArgumentTypeError(f"bootstrap address {text!r} is not a valid multiaddr with a peer id ({exc})") from None
    return text


def _relay_addr(text: str) -> str:
    from murmur.node.net.relay import split_peer

    if text == AUTO_RELAY:
        return text
    try:
        split_peer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0-65535")
    return port


def _view_size(text: str) -> int | None:
    """0 keeps every peer: `None`, as `NodeConfig.view_size` has it."""
    size = int(text)
    if size < 0:
        raise argparse.ArgumentTypeError(f"view size {size} is negative (0 keeps every peer)")
    return size or None


def _task_name(text: str) -> str:
    from murmur.node.learn.tasks import UnknownTask, check_task_name

    try:
        return check_task_name(text)
    except UnknownTask as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _task_names() -> list[str]:
    from murmur.node.learn.tasks import BUILTIN_TASKS

    return list(BUILTIN_TASKS)


def _partner_names() -> list[str]:
    from murmur.node.net.partners import PARTNER_CHOICES

    return sorted(PARTNER_CHOICES)


def _rule_names() -> list[str]:
    from murmur.node.learn.rules import RULES  # imports torch: only once a parser is built

    return sorted(RULES)


def _merge_names() -> list[str]:
    from murmur.node.learn.rules import MERGES

    return list(MERGES)


def _share_of_names() -> list[str]:
    from murmur.node.averaging.averager import SHARE_OF

    return list(SHARE_OF)


def _compression_names() -> list[str]:
    from murmur.node.learn.deltas import COMPRESSIONS

    return list(COMPRESSIONS)


def _bits(text: str) -> int:
    from murmur.protocol.messages import SPARSE_BITS

    if text not in {str(b) for b in SPARSE_BITS}:
        raise argparse.ArgumentTypeError(f"{text} is not one of {list(SPARSE_BITS)}")
    return int(text)


def _optimizer_state_names() -> list[str]:
    from murmur.node.learn.rules import OPTIMIZER_STATE

    return list(OPTIMIZER_STATE)


def _wandb_project(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a W&B project name cannot be empty")
    return text


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _decay(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a decay in [0, 1)")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction in (0, 1]")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


# --- the settings ---------------------------------------------------------------------------------


@dataclass
class NodeConfig:
    """Everything `murmur run` can set for its node; defaults suit a small local swarm."""

    data_dir: Path = option(DEFAULT_DATA_DIR, "identity key, status and metrics (default ~/.murmur)")
    task: str = option("digits", "what to train: a built-in task ({names}) or package.module:factory for your own",
                       parse=_task_name, names=_task_names, metavar="TASK")
    run_id: str | None = option(None, "swarm run id; peers only pair within one run (default: the task name)")
    listen: list[str] = option(factory=lambda: [DEFAULT_LISTEN], metavar="MULTIADDR",
                               help=f"listen address, repeatable (default {DEFAULT_LISTEN})")
    bootstrap: list[str] = option(factory=list, parse=_bootstrap_addr, metavar="MULTIADDR",
                                  help="a peer to join through: /ip4/…/tcp/…/p2p/<id>, repeatable")
    announce: list[str] = option(factory=list, parse=_announce_addr, metavar="MULTIADDR",
                                 help="public address peers should dial instead of the listen addresses (port mapping, NAT), repeatable")
    relays: list[str] = option(factory=list, flag="relay", parse=_relay_addr, metavar="MULTIADDR",
                               help="circuit-relay v2 peer (/ip4/…/tcp/…/p2p/<id>) to reserve a slot on when this node cannot be "
                                    "dialed directly; it is then reached at <relay>/p2p-circuit/p2p/<own id>, repeatable; "
                                    "'auto' (the default without --relay): when AutoNAT finds this node private, reserve "
                                    "on peers that run --relay-service")
    relay_service: bool = option(False, "relay (circuit v2 hop) for peers behind NAT, within fixed limits")
    nat_traversal: bool = option(True, "no AutoNAT, hole punching (DCUtR) or relay discovery", flag="no-nat-traversal")
    addr_file: Path | None = option(None, "write the listening (then announced) addresses here, one per line")
    weighting: str = option("work", "how to weight the two models of a merge", choices=_rule_names)
    merge: str = option("average", "what a merge does with the weighted pair: average moves to its mean", choices=_merge_names)
    optimizer_state: str = option("keep", "what a merge does with the inner optimizer's per-parameter state (Adam's moments, "
                                          "SGD's momentum): keep this peer's own", choices=_optimizer_state_names)
    ema_decay: float = option(DEFAULT_DECAY, "evaluate and checkpoint an average of the model's last ~1/(1-DECAY) steps (a moving "
                                   "average of its weights: less minibatch noise); 0: the live model", parse=_decay,
                              metavar="DECAY")
    average_every: float = option(0.1, "seconds between averaging attempts", metavar="SECONDS")
    exchange_share: float = option(1.0, "the most of this node's time its exchanges may take (see --exchange-share-of): attempts "
                                         "wait at least the typical exchange's cost divided by this", parse=_share, metavar="FRACTION")
    exchange_share_of: str = option("cpu", "what --exchange-share limits: cpu, the time exchanges spend computing (encryption, "
                                           "codec, merging; waiting on a slow link is free), or wall, their whole duration",
                                    choices=_share_of_names)
    exchange_timeout: float = option(10.0, "give up an exchange or state sync after this long, plus 1.25× the model's "
                                           "transfer time at --min-link-mbit; a partner that keeps this node waiting a "
                                           "fifth of it longer than its bytes justify gives way to one it merged with "
                                           "before", metavar="SECONDS")
    min_link_mbit: float = option(5.0, "the slowest link an exchange is given time for (see --exchange-timeout)",
                                  parse=_positive_float, metavar="MBIT")
    partners: str = option("uniform", "how to pick exchange partners: uniform (any live peer)", choices=_partner_names)
    score_windows: int = option(0, "before merging, score the merged model on this many held windows of this peer's own "
                                   "data and refuse a merge that raises their loss by more than --score-tolerance (trusted "
                                   "partners are scored less often; built-in loop only, not delta gossip); 0: off",
                                parse=_nonnegative_int, metavar="N")
    score_tolerance: float = option(0.01, "with --score-windows: the relative rise of the held loss a merge may cause",
                                    parse=_share, metavar="FRACTION")
    gossip_every: float = 1.0
    liveness_timeout: float = option(10.0, "drop peers silent for this long", metavar="SECONDS")
    view_size: int | None = option(32, "peers kept in the membership view, a rotating sample of the swarm (0: all)",
                                   parse=_view_size, metavar="N")  # None: every peer
    eval_every: float = option(1.0, "evaluate on held-out data this often", metavar="SECONDS")
    duration: float | None = option(None, "stop after this many seconds of training", metavar="SECONDS")
    shard: int | None = option(None, "data shard / seed (default: derived from the peer id)")
    sync_state: bool = option(True, "do not pull the swarm's model before the first step", flag="no-state-sync")
    checkpoint_every: float = option(30.0, "checkpoint this often (and on exit)", metavar="SECONDS")
    progress_every: float = option(30.0, "log a one-line progress summary this often, at INFO (0: never)", metavar="SECONDS")
    allow_peers: Path | None = option(None, "only these peer IDs (one per line) may connect", metavar="FILE")
    swarm_secret_file: Path | None = option(None, "shared secret that Murmur streams must prove", metavar="FILE")
    max_connections: int = option(300, "connection limit (inbound + outbound)")
    wire_dtype: str = option("int8", "dtype parameters travel in when this node starts an exchange (state sync is float32): "
                                     "float32 (exact), bfloat16/float16 (half the bytes), int8 (a quarter, per-tensor scale)",
                             choices=lambda: WIRE_DTYPE_NAMES)
    compression: str = option("none", "what exchanges send: none, whole models, averaged pairwise (in --wire-dtype); sparse, each "
                                      "peer's progress as deltas of its largest --compression-density entries in --compression-bits "
                                      "bits, passed on through the swarm; strong, sparse at density 0.005 and 2 bits. Every peer of "
                                      "a swarm must use the same", choices=_compression_names)
    compression_density: float = option(0.01, "with --compression sparse: the share of each tensor's entries a delta sends",
                                        parse=_share, metavar="FRACTION")
    compression_bits: int = option(2, "with --compression sparse: the bits each entry of a delta travels in (2, 4 or 8)",
                                   parse=_bits, metavar="BITS")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps; auto = cuda if available, else mps, else cpu (default auto)",
                         parse=_device_syntax, metavar="DEVICE")  # murmur.node.learn.device.resolve_device
    mixed_precision: bool = option(False, "bf16 autocast for forward pass and loss (CUDA only)")
    metrics_port: int | None = option(None, "serve Prometheus metrics at http://HOST:PORT/metrics and a dashboard at http://HOST:PORT/ (0: any free port; default off)",
                                      parse=_port, metavar="PORT")
    metrics_host: str = option("127.0.0.1", "address the metrics and dashboard endpoint binds to (default 127.0.0.1; 0.0.0.0 for all, with a warning)",
                               metavar="HOST")
    tensorboard: Path | None = option(None, "write TensorBoard scalars (loss, held-out metrics, samples/s, merges, bytes, peers) "
                                            "to this folder at each status tick; needs pip install 'murmur-gossip[tensorboard]'",
                                      metavar="DIR")
    wandb: str | None = option(None, "log the same scalars to this Weights & Biases project, one run per node grouped by run id; "
                                     "entity, mode and run name from WANDB_* variables; needs pip install 'murmur-gossip[wandb]'",
                               parse=_wandb_project, metavar="PROJECT")
    threads: int | None = option(None, "torch threads for training (default: torch's own, usually one per core)",
                                 parse=_positive_int, metavar="N")


@dataclass
class Emulation:
    """`murmur run`'s settings for testing a swarm on one machine, never for a real peer: they emulate slower hardware."""

    GROUP: ClassVar[str] = "testing (emulation on one machine; not for real peers)"

    slowdown: float = option(1.0, "emulate a device S times slower (sleep (S-1) x compute after each step)")


@dataclass
class RunOptions:
    """The settings of the `murmur run` process around its node: where they came from, and its log output."""

    log_level: str = option("INFO", "log records this severe and worse (default INFO)", parse=str.upper,
                            choices=lambda: LOG_LEVELS)
    log_format: str = option("text", "text: readable lines; json: one JSON object per line (time, level, logger, message, peer)",
                             choices=lambda: LOG_FORMATS)
    config: Path | None = option(None, "TOML file of options (see below); flags and MURMUR_* variables override it", metavar="FILE")


class _Repeatable(argparse._AppendAction):
    """A repeatable option whose first use replaces the default list instead of adding to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        items = getattr(namespace, self.dest, None)
        items = [] if items is None or items is self.default else items
        setattr(namespace, self.dest, [*items, values])


SETTINGS: tuple[type, ...] = (NodeConfig, RunOptions, Emulation)  # every `murmur run` option, in `--help` order


def option_of(f: Field) -> Option | None:
    """How the dataclass field `f` appears on the command line, or None if it is not an option."""
    return f.metadata.get(_OPTION)


def add_options(parser: argparse.ArgumentParser, settings: Sequence[type] = SETTINGS) -> None:
    """Add an option to `parser` for every `option` field of the `settings` dataclasses
    (in an argument group of its own for a class that names one in `GROUP`)."""
    for cls in settings:
        group = getattr(cls, "GROUP", None)
        target = parser.add_argument_group(group) if group else parser
        hints = get_type_hints(cls)
        for f in fields(cls):
            how = option_of(f)
            if how is None:
                continue
            default = f.default if f.default_factory is MISSING else f.default_factory()
            kind, repeatable = value_type(hints[f.name])
            spec: dict[str, Any] = {"dest": f.name, "default": default, "help": how.help_text()}
            if kind is bool:
                spec["action"] = "store_false" if default else "store_true"
            else:
                spec.update(type=how.parse or kind, metavar=how.metavar, action=_Repeatable if repeatable else "store")
                if how.choices is not None:
                    spec["choices"] = how.choices()
            target.add_argument("--" + (how.flag or f.name.replace("_", "-")), **spec)


def value_type(hint: Any) -> tuple[Any, bool]:
    """The type one value of a field has, and whether the field is a list (a repeatable option)."""
    if get_origin(hint) is list:
        return get_args(hint)[0], True
    kinds = [kind for kind in get_args(hint) if kind is not type(None)]
    return (kinds[0] if kinds else hint), False


def run_settings(args: argparse.Namespace) -> tuple[NodeConfig, RunOptions, Emulation]:
    """The settings a parser from `add_options` parsed (after `resolve_options`), field by field."""
    return _build(NodeConfig, args), _build(RunOptions, args), _build(Emulation, args)


def _build(cls: type, args: argparse.Namespace) -> Any:
    values = {}
    for f in fields(cls):
        if _OPTION not in f.metadata:
            continue
        value = getattr(args, f.name)
        if value == [] and f.default_factory is not MISSING:
            value = f.default_factory()  # an empty list (`listen = []`, `MURMUR_LISTEN=`) keeps the default
        values[f.name] = value
    return cls(**values)
