"""The closed vocabularies the core and its drivers share: compute kinds and record names.

Owns `ComputeKind`, the `kind` of every `messages.Compute` effect: what a driver runs for it
(docs/protocol.md, the driver contract), and `RecordName`, the `event` of every `Record` (the
core's facts, and the records the runtime adds to a node's records.jsonl). Both are
`enum.StrEnum`, so each member is its string: records.jsonl, metrics, audit and fault points keep
the same names (contracts), and a plain string compares equal to (and hashes like) its member.

A leaf module (imports nothing of gwtf). Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class ComputeKind(StrEnum):
    """One stage computation a `Compute` effect asks the driver to run."""

    EMBED = "embed"  # data holder: embedding forward of one microbatch
    FORWARD = "forward"  # a relay's stage forward
    LOSS = "loss"  # data holder: head forward + backward, the gradient w.r.t. the returned activation
    BACKWARD = "backward"  # a relay's backward: accumulates the stage's parameter gradients
    EMBED_BACKWARD = "embed_backward"  # data holder: the embedding's backward
    EXPORT_GRAD = "export_grad"  # the accumulated gradient -> a key; n > 1 keys: its n contiguous parts, in order
    RESET_GRAD = "reset_grad"  # discard the accumulated gradients
    REDUCE = "reduce"  # sum the input gradients in the given order, divide by `count`
    CONCAT = "concat"  # the input gradient parts joined in order -> one key (butterfly all-gather)
    STEP = "step"  # optimizer step on the reduced gradient
    EXPORT_STATE = "export_state"  # weights + optimizer state -> a key (a joiner's transfer)
    IMPORT_STATE = "import_state"  # ... and back from a key
    LOAD_CHECKPOINT = "load_checkpoint"  # this host's checkpoint copy
    EXPORT_CHECKPOINT = "export_checkpoint"  # a replica: the checkpoint it just wrote -> a "ckpt" key
    STORE_CHECKPOINT = "store_checkpoint"  # a data holder: keep a received "ckpt" key on disk
    READ_CHECKPOINT = "read_checkpoint"  # a data holder: its copy of a stage's checkpoint -> a "ckpt" key


DISK_KINDS = frozenset({ComputeKind.LOAD_CHECKPOINT, ComputeKind.READ_CHECKPOINT, ComputeKind.STORE_CHECKPOINT})
"""Computes that read or write a checkpoint (the simulator charges their bytes at disk bandwidth)."""

STAGE0_KINDS = frozenset({ComputeKind.EMBED, ComputeKind.LOSS, ComputeKind.EMBED_BACKWARD,
                          ComputeKind.STORE_CHECKPOINT, ComputeKind.READ_CHECKPOINT})
"""Computes only a stage-0 node (a data holder) is ever asked to run: its microbatches' embedding,
loss and embedding backward (`protocol.training`), and its copies of the relay stages'
checkpoints (`protocol.membership`: kept and served by a stage-0 node only)."""
RELAY_KINDS = frozenset({ComputeKind.FORWARD, ComputeKind.BACKWARD, ComputeKind.EXPORT_CHECKPOINT})
"""Computes only a relay (a stage >= 1, any of them) is ever asked to run: a stage's forward and
backward (`protocol.training`), and a replica's checkpoint sent to the data holders
(`protocol.aggregation`). Every other kind (gradient aggregation, the optimizer step, state
transfer, loading a checkpoint) runs at any stage."""


@unique
class RecordName(StrEnum):
    """The `event` of a `Record` effect or a records.jsonl line."""

    # the core's (`messages.record`): the simulator's metrics and invariants, the node's records.jsonl
    ABANDONED = "abandoned"
    ACTIVATED = "activated"
    ADMIT_HOLD = "admit_hold"
    ADMIT_TIMEOUT = "admit_timeout"
    AGG_RESET = "agg_reset"
    CHAIN_FAILED = "chain_failed"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FALLBACK = "checkpoint_fallback"
    CHECKPOINT_FETCHED = "checkpoint_fetched"
    COLLECT = "collect"
    COMPUTE_ADVERTISED = "compute_advertised"
    COMPUTE_FAILED = "compute_failed"
    CONTRIBUTE = "contribute"
    DEAL = "deal"
    DEAL_TAKEN = "deal_taken"
    DECISION = "decision"
    DH_LOST = "dh_lost"
    DUP_RETURN = "dup_return"
    EVICT = "evict"
    FINAL_COPIES_WAIT = "final_copies_wait"
    GRAD_PASSED_ON = "grad_passed_on"
    ITER_SEEN = "iter_seen"
    ITER_START = "iter_start"
    ITERATION_DONE = "iteration_done"
    JOIN = "join"
    JOIN_RETRY = "join_retry"
    JOIN_STAGE = "join_stage"
    JOIN_START = "join_start"
    JOINER_REASSIGNED = "joiner_reassigned"
    LEADER_CHANGE = "leader_change"
    LEADER_LOST = "leader_lost"
    LEADER_STEPDOWN = "leader_stepdown"
    LEADER_TAKEOVER = "leader_takeover"
    LEADER_TERM = "leader_term"
    LEAVE = "leave"
    MB_INCOMPLETE = "mb_incomplete"
    MB_RESTART = "mb_restart"
    MB_START = "mb_start"
    REBALANCE = "rebalance"
    REDO = "redo"
    REJOIN = "rejoin"
    REROUTE = "reroute"
    RESET = "reset"
    ROLLBACK = "rollback"
    ROLLBACK_NODE = "rollback_node"
    SELF_STOP = "self_stop"
    STAGE_LOST = "stage_lost"
    STAGE_MOVE = "stage_move"
    STATE_SOURCE_LOST = "state_source_lost"
    STATE_TIMEOUT = "state_timeout"
    STEP = "step"
    SUSPECT = "suspect"
    SWARM_MOVE = "swarm_move"
    TRAINING_DONE = "training_done"
    TRAINING_OVER = "training_over"  # this node is done: the run ended (the leader's Finish), its final copies are in
    UNAUTHORIZED = "unauthorized"
    # the runtime's compute jobs (`drive.ComputeResult`), in records.jsonl
    TOKENS = "tokens"
    LOSS = "loss"
    STEPPED = "stepped"
    STATE_EXPORTED = "state_exported"
    STATE_IMPORTED = "state_imported"
    STATE_LOADED = "state_loaded"
    CHECKPOINT_STORED = "checkpoint_stored"
    CHECKPOINT_EXPORTED = "checkpoint_exported"
    CHECKPOINT_SERVED = "checkpoint_served"
    # the node process's own (`NodeRuntime.record`; a graceful leave is the core's LEAVE)
    MESSAGE_REFUSED = "message_refused"
    LOOP_STALL = "loop_stall"
    FAULT = "fault"
