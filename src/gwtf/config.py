"""The one config system: frozen dataclasses, TOML files, `--set section.key=value` overrides.

Owns: every config section of the project and the generic loader that fills them from plain
dicts with strict checks (unknown keys and wrong types are errors naming the key).
Layering: defaults < TOML file < `--set` overrides. Must not import anything from gwtf except
`errors`.

Other dataclass trees (e.g. simulator scenarios) reuse `from_dict` / `to_dict` / `apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from gwtf.errors import UserError

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Which model to train and how it is cut into stages."""

    family: Literal["gpt", "llama"] = "gpt"  # gpt: learned pos, LayerNorm, GELU; llama: RMSNorm, RoPE, SwiGLU, GQA
    # model size (model.presets: layers, width, heads); "custom": n_layer, d_model, n_head and d_ff below give it
    preset: Literal["tiny", "small", "124m", "500m", "1b", "custom"] = "tiny"
    seq_len: int = 128  # tokens per sequence (context length)
    microbatch_size: int = 8  # sequences per microbatch
    stages: int = 3  # pipeline stages incl. stage 0 (embedding + head, on data holders)
    dropout: float = 0.0  # dropout probability in the transformer blocks
    # start from these weights instead of the seeded init: a gwtf checkpoint (a `gwtf train --local` or
    # `gwtf import` folder) or a Hugging Face GPT-2 / Llama folder; the model's shape keys below and its
    # tokenizer come from it, and a shape key set to another value is an error (docs/models.md); "" = none
    init_from: str = ""
    n_layer: int = 0  # transformer blocks; 0 = the preset's
    d_model: int = 0  # hidden width; 0 = the preset's
    n_head: int = 0  # attention heads; 0 = the preset's
    n_kv_head: int = 0  # key/value heads (llama: grouped-query attention; gpt: n_head); 0 = the preset's, custom: n_head
    d_ff: int = 0  # MLP hidden width; 0 = the preset's
    vocab_size: int = 0  # token embedding rows; 0 = the tokenizer's vocabulary size (else at least that)
    max_positions: int = 0  # longest sequence the model takes (gpt: learned position rows); 0 = seq_len
    rope_theta: float = 10000.0  # llama: RoPE base frequency
    norm_eps: float = 1e-5  # epsilon of the LayerNorms (gpt) / RMSNorms (llama)

    def __post_init__(self) -> None:
        _require(self.seq_len >= 2, "model.seq_len", "must be >= 2")
        _require(self.microbatch_size >= 1, "model.microbatch_size", "must be >= 1")
        _require(self.stages >= 2, "model.stages", "must be >= 2 (stage 0 plus at least one relay stage)")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        for key in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "max_positions"):
            _require(getattr(self, key) >= 0, f"model.{key}", "must be >= 0 (0: the preset's / derived)")
        for key in ("n_layer", "d_model", "n_head", "d_ff"):
            _require(self.preset != "custom" or getattr(self, key) > 0, f"model.{key}",
                     'must be set (> 0) with model.preset = "custom"')
        _require(self.max_positions == 0 or self.max_positions >= self.seq_len, "model.seq_len",
                 f"must be <= model.max_positions ({self.max_positions})")
        _require(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        _require(self.norm_eps > 0, "model.norm_eps", "must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where tokens come from."""

    # "shakespeare", "synthetic", or a path: a .txt, .jsonl, .jsonl.gz or .parquet file, or a folder of
    # them (docs/data.md); a path corpus is tokenized once by `gwtf data prepare` (training does it if needed)
    source: str = "shakespeare"
    # "bpe": byte-level BPE trained on the corpus; "byte": 256 bytes + specials; else the path of a
    # tokenizer.json or of a Hugging Face folder holding one (loaded offline with `tokenizers`; docs/models.md)
    tokenizer: str = "bpe"
    vocab_size: int = 2048  # BPE vocabulary size (byte tokenizer: fixed 256 + specials)
    cache_dir: str = ""  # "" = $GWTF_CACHE or ~/.cache/gwtf
    val_fraction: float = 0.02  # share of the corpus' tokens held out for validation
    synthetic_bytes: int = 400_000  # size of the generated synthetic corpus
    text_field: str = "text"  # the field holding a record's text in .jsonl / .jsonl.gz / .parquet files
    glob: str = ""  # files of a folder source, e.g. "**/*.jsonl"; "" = *.txt, *.jsonl, *.jsonl.gz, *.parquet
    # "random": each microbatch row a random window of the shard (with replacement); "epoch": every
    # (seq_len + 1)-token window of the shard once per epoch, in a seeded order per epoch (docs/data.md)
    order: Literal["random", "epoch"] = "random"
    bpe_sample_mb: int = 32  # path corpora: the BPE is trained on the corpus' first this many MB of text
    prepare_workers: int = 0  # processes tokenizing a path corpus; 0 = one per CPU core

    def __post_init__(self) -> None:
        _require(self.tokenizer.strip() != "", "data.tokenizer", 'must be "bpe", "byte" or a tokenizer path')
        _require(self.vocab_size >= 260, "data.vocab_size", "must be >= 260")
        _require(0.0 <= self.val_fraction < 0.5, "data.val_fraction", "must be in [0, 0.5)")
        _require(self.synthetic_bytes >= 10_000, "data.synthetic_bytes", "must be >= 10000")
        _require(self.text_field != "", "data.text_field", "must not be empty")
        _require(self.bpe_sample_mb >= 1, "data.bpe_sample_mb", "must be >= 1")
        _require(self.prepare_workers >= 0, "data.prepare_workers", "must be >= 0 (0: one per CPU core)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Iteration semantics (DESIGN.md section 3) and the optimizer."""

    seed: int = 0  # seed of initialisation, data order and every seeded choice
    data_holders: int = 2  # D: each owns a disjoint data shard
    microbatches: int = 4  # M: microbatches per data holder per iteration
    iterations: int = 200  # K: iterations (optimizer steps) to train
    lr: float = 1e-3  # peak learning rate (AdamW), after warmup; cosine decay to min_lr
    min_lr: float = 1e-4  # learning rate at the last iteration (cosine floor)
    warmup_iterations: int = 10  # iterations of linear learning-rate warmup
    weight_decay: float = 0.1  # AdamW weight decay (decoupled)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    torch_threads: int = 0  # 0 = torch default
    checkpoint_every: int = 50  # iterations; 0 = only at the end
    time_limit_s: float = 0.0  # stop after this much wall time; 0 = no limit
    eval_every: int = 25  # iterations between validation-loss evaluations; 0 = only at the end
    eval_microbatches: int = 4  # fixed validation microbatches per evaluation
    # where stages compute: "auto" = cuda when available, else cpu; `--device` overrides (docs/gpu.md)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # compute precision: "fp32", or "bf16-autocast" = bfloat16 autocast of forward/backward with
    # float32 master weights and optimizer state (on the CPU it works but is slow); the wire
    # always carries float32
    precision: Literal["fp32", "bf16-autocast"] = "fp32"
    # `gwtf train --local` only: round every activation and activation gradient at a stage
    # boundary as the [wire] formats do (gwtf.model.wire.roundtrip), so the local trainer takes
    # the steps of a swarm with those wire formats; false = exact fp32 boundaries
    local_rounding: bool = False
    # 0: every iteration's passes run on the weights its predecessor stepped to (synchronous);
    # 1: iteration t+1's passes start while iteration t's within-stage reduction is under way, on
    # weights one step older (each stage applies step t after exporting t+1's gradient): the
    # reduction overlaps the next passes (docs/protocol.md, "Overlapped aggregation")
    update_delay: int = 0

    def __post_init__(self) -> None:
        _require(self.seed >= 0, "train.seed", "must be >= 0")
        _require(self.update_delay in (0, 1), "train.update_delay", "must be 0 or 1")
        _require(self.data_holders >= 1, "train.data_holders", "must be >= 1")
        _require(self.microbatches >= 1, "train.microbatches", "must be >= 1")
        _require(self.iterations >= 0, "train.iterations", "must be >= 0")
        _require(self.lr > 0, "train.lr", "must be > 0")
        _require(0 <= self.min_lr <= self.lr, "train.min_lr", "must be in [0, train.lr]")
        _require(self.warmup_iterations >= 0, "train.warmup_iterations", "must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _require(0 <= self.beta1 < 1, "train.beta1", "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "train.beta2", "must be in [0, 1)")
        _require(self.torch_threads >= 0, "train.torch_threads", "must be >= 0")
        _require(self.time_limit_s >= 0, "train.time_limit_s", "must be >= 0 (0: no limit)")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        _require(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        _require(self.eval_microbatches >= 0, "train.eval_microbatches", "must be >= 0")


WireFormatName = Literal["fp32", "bf16", "fp16", "int8"]  # gwtf.model.wire.FORMATS


@dataclass(frozen=True, kw_only=True, slots=True)
class WireConfig:
    """How activations and activation gradients travel between stages (docs/wire-formats.md).

    Compute stays float32 whatever the format; the simulator's message sizes follow the same
    keys (`gwtf.model.wire.wire_bytes`). Every node of a swarm must use the same [wire] section.
    """

    # forward activations: "fp32" (4 bytes/value, as computed), "bf16" / "fp16" (2 bytes/value),
    # "int8" (blockwise absmax: 1 byte/value + one float32 scale per block_values values)
    activations: WireFormatName = "int8"
    gradients: WireFormatName = "int8"  # activation gradients sent backward; same choices
    # the within-stage reduction's parts (each replica's gradient, and the reduced mean every
    # replica applies): same choices; all replicas apply the same decoded mean (bit-identical)
    stage_gradients: WireFormatName = "int8"
    # stage gradients in a lossy format keep the compression residual and add it back next
    # iteration (error feedback), so the rounding error does not accumulate
    error_feedback: bool = True
    block_values: int = 4096  # int8 only: values per quantisation block (one float32 scale each)

    def __post_init__(self) -> None:
        _require(1 <= self.block_values <= 2**24, "wire.block_values", "must be in [1, 16777216]")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """The real runtime's wire and transport limits (docs/wire.md)."""

    max_frame_bytes: int = 256 * 2**20  # hard cap on one frame (header + tensors)
    connect_timeout_s: float = 5.0  # TCP connect + swarm-secret handshake
    request_timeout_s: float = 30.0  # default deadline of one send
    secret_file: str = ""  # "" = $GWTF_SWARM_SECRET, else the public dev secret (loopback addresses only)
    torch_threads: int = 1  # torch threads per node process (several nodes share a machine); 0 = torch default
    status_period_s: float = 0.5  # how often a node rewrites DIR/nodes/<id>/status.json
    ready_timeout_s: float = 90.0  # launcher: deadline for a node's READY line
    wan: str = ""  # "" = no WAN emulation; else a network name (e.g. "geo10") whose delays are emulated
    fault: str = ""  # fault injection for chaos tests, e.g. "crash:compute=forward:iter=2:mb=1" (docs/faults.md)
    start_members: int = 0  # leader: hold iteration 0 until this many nodes are members (0 = a replica per stage)
    chunk_bytes: int = 32 * 2**20  # a larger message body travels in chunks of this size, at most max_frame_bytes/2
    max_transfer_bytes: int = 64 * 2**30  # receiver: cap on one chunked message's declared body
    transfer_retries: int = 3  # sender: reconnects (resuming) after a chunked transfer's connection is lost
    # where a node keeps its checkpoints: "shared" = DIR/checkpoints (one host: every node of a local
    # swarm shares it), "per-node" = DIR/nodes/<name>/checkpoints (one host per node, as on several
    # machines: for trying and testing the multi-host restore path on one machine; no --resume)
    checkpoint_folder: Literal["shared", "per-node"] = "shared"
    # >= 1: this node's microbatch jobs take this many times their real time (the worker sleeps
    # the difference, and the measured compute time includes it): a slow GPU for tests and demos
    compute_slowdown: float = 1.0
    progress_every: int = 10  # `gwtf node`: a progress line on stdout every this many iterations (and the last); 0 = none

    def __post_init__(self) -> None:
        _require(self.progress_every >= 0, "runtime.progress_every", "must be >= 0")
        _require(self.max_frame_bytes >= 2**16, "runtime.max_frame_bytes", "must be >= 65536")
        _require(self.torch_threads >= 0, "runtime.torch_threads", "must be >= 0")
        _require(self.status_period_s > 0, "runtime.status_period_s", "must be > 0")
        _require(self.ready_timeout_s > 0, "runtime.ready_timeout_s", "must be > 0")
        _require(self.connect_timeout_s > 0, "runtime.connect_timeout_s", "must be > 0")
        _require(self.request_timeout_s > 0, "runtime.request_timeout_s", "must be > 0")
        _require(self.chunk_bytes >= 4096, "runtime.chunk_bytes", "must be >= 4096")
        _require(self.max_transfer_bytes >= self.chunk_bytes, "runtime.max_transfer_bytes", "must be >= runtime.chunk_bytes")
        _require(self.transfer_retries >= 0, "runtime.transfer_retries", "must be >= 0")
        _require(self.start_members >= 0, "runtime.start_members", "must be >= 0")
        _require(1.0 <= self.compute_slowdown <= 1000.0, "runtime.compute_slowdown", "must be in [1, 1000]")


@dataclass(frozen=True, kw_only=True, slots=True)
class FlowConfig:
    """The decentralized flow protocol's knobs (PAPER.md 3.3, docs/flow-protocol.md)."""

    tick_s: float = 1.0  # period of every node's flow tick (requests, annealing, checks)
    tick_max_s: float = 0.0  # > tick_s: quiet ticks double the period up to this (Trickle); 0 = fixed
    advert_interval_s: float = 0.2  # least gap between two cost advertisements of one node
    advert_tolerance: float = 0.0  # re-advertise only when a cost moved by more than this fraction
    request_timeout_s: float = 5.0  # a reservation with no answer by then counts as refused
    request_tries: int = 4  # next hops one node tries for a reservation before refusing upstream
    max_pending_requests: int = 4  # data holder: reservations in progress at once
    anneal_probability: float = 0.5  # chance per tick that a relay starts an annealing move
    anneal_t0_s: float = 0.05  # initial temperature, in seconds of route cost
    anneal_cooling: float = 0.95  # T <- cooling * T after every annealing attempt
    anneal_min_t_s: float = 1e-4  # below this only strictly improving moves are proposed
    anneal_reheat: float = 0.5  # on crash / join / link change: T <- max(T, reheat * T0)
    anneal_tournament: int = 3  # peers sampled per move; the one showing the dearest route is asked
    anneal_swap_next: bool = False  # also try swapping next hops (whole tails) of same-origin flows
    anneal_claim: bool = False  # blocked data holders claim full relays' slots from costlier routes (opt-in: docs/flow-protocol.md "Claims")
    claim_margin: float = 0.02  # a claim releases a route only if it costs > (1 + this) x the new one
    load_aware: bool = False  # price queueing: a node carrying k flows costs compute x (k+1)/2 (flow.cost.queue_factor; announced with flow.load)
    cooldown_ticks: int = 5  # a same-stage peer just interacted with is left alone this long
    stable_s: float = 2.0  # a flow changed more recently than this is not offered for moves
    check_every_ticks: int = 15  # consistency check of every flow with its neighbours
    tombstone_s: float = 30.0  # how long a node forwards notices about a flow it handed over

    def __post_init__(self) -> None:
        _require(self.tick_s > 0, "flow.tick_s", "must be > 0")
        _require(self.tick_max_s >= 0, "flow.tick_max_s", "must be >= 0 (0: a fixed tick period)")
        _require(self.advert_interval_s >= 0, "flow.advert_interval_s", "must be >= 0")
        _require(0.0 <= self.advert_tolerance < 1.0, "flow.advert_tolerance", "must be in [0, 1)")
        _require(self.request_timeout_s > 0, "flow.request_timeout_s", "must be > 0")
        _require(self.request_tries >= 1, "flow.request_tries", "must be >= 1")
        _require(self.max_pending_requests >= 1, "flow.max_pending_requests", "must be >= 1")
        _require(0.0 <= self.anneal_probability <= 1.0, "flow.anneal_probability", "must be in [0, 1]")
        _require(self.anneal_t0_s >= 0, "flow.anneal_t0_s", "must be >= 0")
        _require(0.0 < self.anneal_cooling <= 1.0, "flow.anneal_cooling", "must be in (0, 1]")
        _require(self.anneal_min_t_s >= 0, "flow.anneal_min_t_s", "must be >= 0")
        _require(0.0 <= self.anneal_reheat <= 1.0, "flow.anneal_reheat", "must be in [0, 1]")
        _require(self.anneal_tournament >= 1, "flow.anneal_tournament", "must be >= 1")
        _require(self.claim_margin >= 0, "flow.claim_margin", "must be >= 0")
        _require(self.cooldown_ticks >= 0, "flow.cooldown_ticks", "must be >= 0")
        _require(self.stable_s >= 0, "flow.stable_s", "must be >= 0")
        _require(self.tombstone_s >= 0, "flow.tombstone_s", "must be >= 0")
        _require(self.check_every_ticks >= 1, "flow.check_every_ticks", "must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProtocolConfig:
    """NodeCore's churn-handling knobs: failure detection, deadlines, checkpoints (docs/protocol.md)."""

    system: str = "gwtf"  # the system every node runs: "gwtf" or "swarm" (the baseline); protocol.systems
    router: Literal["greedy", "flow"] = "flow"  # next-hop choice: protocol.simple_router or protocol.routing
    heartbeat_period_s: float = 2.0  # node -> leader heartbeats; leader -> node acks
    suspect_after_s: float = 6.0  # no word from the leader this long: suspect it (log)
    evict_after_s: float = 12.0  # leader: silent node declared dead; node: leader declared dead
    deadline_multiplier: float = 3.0  # ack deadline = multiplier x EMA of the observed ack delay
    deadline_floor_s: float = 2.0  # ... but never below this
    ema_alpha: float = 0.3  # weight of a new observation in every moving average
    mb_deadline_multiplier: float = 4.0  # data holder: restart a microbatch after this x EMA round trip
    mb_deadline_floor_s: float = 60.0  # ... but never before this
    retry_period_s: float = 1.0  # parked work (no live next hop) is retried this often
    partition_timeout_s: float = 60.0  # a node that cannot reach any leader this long stops
    checkpoint_every: int = 10  # iterations between (modelled) checkpoints; a lost stage rolls back to one
    checkpoint_replicate: bool = True  # at each checkpoint a replica of every relay stage sends it to the data holders
    # ... and, while at most stage0_copies_max_dhs data holders are live, the data holders send stage 0's to this
    # many relays (the lowest-id replica of stage 1, 2, ...), so that stage 0 survives losing every data holder on
    # machines of their own (0: never; a joiner restores stage 0 from a relay's copy, else its own disk)
    stage0_copies: int = 2
    stage0_copies_max_dhs: int = 2  # ... (train.data_holders or more: at every checkpoint)
    # a joiner becomes a data holder (stage 0, a vacant shard) while fewer than train.data_holders are live or
    # joining; false: the paper's behaviour, joiners become relays and a crashed data holder's shard stays vacant
    data_holder_joins: bool = True
    # the global batch is held: while a shard is vacant, the live data holders serve its microbatches too
    # (dealt round-robin at each iteration start), and a crashed one's microbatches are served again within the
    # iteration; false: the paper's behaviour, a vacant shard's share and a crashed one's microbatches are dropped
    hold_batch: bool = True
    swarm_rebalance_period_s: float = 300.0  # SWARM baseline: rebalancing period T (SWARM paper: 300 s)
    swarm_ban_s: float = 60.0  # SWARM baseline: a failed peer is banned this long (its DHT record's life)
    rebalance_period_s: float = 300.0  # gwtf: at most one relay moves to the bottleneck stage per period (0: off)
    rebalance_min_gain: float = 0.02  # gwtf: a move must cut the estimated cost per microbatch by this fraction
    view_size: int = 0  # routers see ~this many peers of each neighbouring stage (0: all; >= 16; protocol.view)
    reduce_fanout: int = 0  # the reduced gradient goes out down a tree of this fan-out (0: the reducer sends to all)
    # how a stage's replicas average gradients: "gather" (every contributor -> one reducer, which sends the
    # mean to all: R-1 gradients on its uplink) or "butterfly" (reduce-scatter + all-gather over R parts:
    # ~2(R-1)/R of a gradient per node; protocol/butterfly.py). Every node of a swarm must use the same.
    reduce: Literal["gather", "butterfly"] = "butterfly"

    def __post_init__(self) -> None:
        for key in ("heartbeat_period_s", "suspect_after_s", "evict_after_s", "deadline_floor_s",
                    "mb_deadline_floor_s", "retry_period_s", "partition_timeout_s"):
            _require(getattr(self, key) > 0, f"protocol.{key}", "must be > 0")
        _require(self.deadline_multiplier >= 1.0, "protocol.deadline_multiplier", "must be >= 1")
        _require(self.mb_deadline_multiplier >= 1.0, "protocol.mb_deadline_multiplier", "must be >= 1")
        _require(0.0 < self.ema_alpha <= 1.0, "protocol.ema_alpha", "must be in (0, 1]")
        _require(self.evict_after_s > self.heartbeat_period_s, "protocol.evict_after_s",
                 "must be > protocol.heartbeat_period_s")
        # a node must vote for a new leader before it gives up on the swarm as partitioned
        _require(self.partition_timeout_s > self.evict_after_s, "protocol.partition_timeout_s",
                 "must be > protocol.evict_after_s")
        _require(self.checkpoint_every >= 1, "protocol.checkpoint_every", "must be >= 1")
        _require(self.stage0_copies >= 0, "protocol.stage0_copies", "must be >= 0")
        _require(self.stage0_copies_max_dhs >= 0, "protocol.stage0_copies_max_dhs", "must be >= 0")
        _require(self.swarm_rebalance_period_s >= 0, "protocol.swarm_rebalance_period_s", "must be >= 0")
        _require(self.swarm_ban_s >= 0, "protocol.swarm_ban_s", "must be >= 0")
        _require(self.rebalance_period_s >= 0, "protocol.rebalance_period_s", "must be >= 0")
        _require(0.0 <= self.rebalance_min_gain < 1.0, "protocol.rebalance_min_gain", "must be in [0, 1)")
        # a node sees none of a stage of n > K peers with probability ~exp(-K): 16 keeps it ~1e-7
        _require(self.view_size == 0 or self.view_size >= 16, "protocol.view_size", "must be 0 (all) or >= 16")
        _require(self.reduce_fanout == 0 or self.reduce_fanout >= 2, "protocol.reduce_fanout",
                 "must be 0 (the reducer sends to every replica) or >= 2")
        _require(self.reduce == "gather" or self.reduce_fanout == 0, "protocol.reduce_fanout",
                 'is a tree of "gather": it must be 0 with protocol.reduce = "butterfly"')


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """The root of the config tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    wire: WireConfig = field(default_factory=WireConfig)


# --------------------------------------------------------------------------------------------
# Generic loader
# --------------------------------------------------------------------------------------------


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise UserError(f"config: {key} {why}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (tuple, list):
        return f"list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to floats, lists to tuples)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"config: {key} must be a table, got {type(value).__name__}")
        return from_dict(tp, value, prefix=key)  # type: ignore[arg-type]
    if origin is Literal:
        if value not in get_args(tp):
            raise UserError(f"config: {key} must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            if arg is type(None) and value is None:
                return None
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except UserError:
                continue
        raise UserError(f"config: {key} must be {_type_name(tp)}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"config: {key} must be a {_type_name(tp)}, got {type(value).__name__}")
        args = get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"config: {key} must be a bool, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config: {key} must be an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config: {key} must be a float, got {value!r}")
        if value != value:  # NaN means nothing for any key (and slips through checks like `not x < 0`)
            raise UserError(f"config: {key} must be a number, got nan")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"config: {key} must be a string, got {value!r}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise UserError(f"config: {key} has unsupported value {value!r}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a plain dict; unknown keys and wrong types raise UserError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise UserError(f"config: unknown key {full!r}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict view of a config dataclass (tuples become lists), suitable for TOML/JSON."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    out = conv(obj)
    assert isinstance(out, dict)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `section.key=value`; the value is read as TOML, or as a bare string if that fails."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise UserError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return keys, value


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides to a nested dict (copy-on-write at each touched level)."""
    out = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for k in keys[:-1]:
            child = node.get(k, {})
            if not isinstance(child, dict):
                raise UserError(f"--set {text!r}: {k!r} is not a section")
            child = dict(child)
            node[k] = child
            node = child
        node[keys[-1]] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a UserError naming it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config file {p} is not valid TOML: {exc}") from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, cls: type[T] = Config  # type: ignore[assignment]
) -> T:
    """defaults < TOML file < overrides -> a validated frozen config of type `cls`."""
    data = read_toml(path) if path else {}
    data = merge_overrides(data, overrides or [])
    return from_dict(cls, data)


def dump_toml(obj: Any) -> str:
    """Serialise a config dataclass to TOML (tables for nested sections)."""
    data = to_dict(obj)
    lines: list[str] = []

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if v is None:
            return '""'
        raise TypeError(f"cannot write {v!r} to TOML")

    def emit(table: dict[str, Any], prefix: str) -> None:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and plain:
            lines.append(f"[{prefix}]")
        for k, v in plain.items():
            lines.append(f"{k} = {scalar(v)}")
        if plain:
            lines.append("")
        for k, v in nested.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(data, "")
    return "\n".join(lines).rstrip() + "\n"


def write_resolved(obj: Any, out_dir: str | Path, name: str = "config.resolved.toml") -> Path:
    """Write the resolved config next to a run's outputs."""
    p = Path(out_dir) / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_toml(obj), encoding="utf-8")
    return p
