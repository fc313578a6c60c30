"""Deterministic, resumable stream of packed fixed-length sequences.

Each stream (one dataset; several for a mixture) is cut into non-overlapping windows:
sequence j covers tokens [j*L, j*L + L + 1) of the concatenated documents, so
consecutive sequences share one token and every token is a target exactly once per epoch.
Windows run across document boundaries (documents end in the end-of-document token).

The run is one global list of sequences, numbered g = 0, 1, 2, ...; step k reads
g in [k*G, (k+1)*G) and data-parallel rank r reads rows [r*G/dp, (r+1)*G/dp) of it.
Which window g maps to depends only on the seed and the data:

- a mixture assigns g to a stream by a fixed schedule: every block of ``MIX_BLOCK``
  consecutive g holds each stream in proportion to its weight, in a seeded random order;
- within a stream, the n-th sequence drawn from it is window perm_e[n mod M] of epoch
  e = n // M, where perm_e is a permutation of the stream's M windows from (seed, stream, e).

So the state is just the position g of the next batch; resuming with another dp size or
another global batch size continues the same order.

With ``val_fraction > 0`` each stream first loses a seeded share of its documents to
validation (``llmforge.data.split``): the ``train`` sampler windows the rest, a ``val``
sampler windows the held-out documents alone, each with its own position and the
same guarantees. ``only_stream`` draws from one dataset of a mixture alone (the
per-dataset validation loss).
"""

from __future__ import annotations

import numpy as np
import torch

from llmforge.data.prepare import PreparedData
from llmforge.data.split import SPLIT_RULE, held_out_masks, open_split
from llmforge.errors import Problem, UserError

MIX_BLOCK = 4096
STATE_VERSION = 1


class BatchSampler:
    """Deterministic stream of packed fixed-length sequences. The order depends only on the seed,
    never on the number of data-parallel ranks: step k's global batch is always the same
    global_batch_size sequences; dp rank r gets rows [r*G/dp, (r+1)*G/dp) of it."""

    def __init__(
        self,
        data: PreparedData,
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        split: str = "train",
        val_fraction: float = 0.0,
        val_seed: int = 0,
        only_stream: int | None = None,
    ) -> None:
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError("seq_len and global_batch_size must be positive")
        if split == "val" and val_fraction <= 0:
            raise ValueError("a val sampler needs val_fraction > 0")
        self.data = data
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.split, self.val_fraction, self.val_seed = split, float(val_fraction), int(val_seed)
        self.position = 0
        self._vocab_size = data.vocab_size
        self.last_sequence_ids = np.zeros((0, 3), dtype=np.int64)
        opened = [data.open_stream(i) for i in range(len(data.streams))]
        masks = (
            held_out_masks([s.doc_ends() for s in opened], fraction=self.val_fraction, seed=self.val_seed, min_tokens=seq_len + 1)
            if self.val_fraction > 0
            else None
        )
        #: Held-out documents of each stream (none when val_fraction is 0 or the data is too small).
        self.held_out_documents = [int(m.sum()) for m in masks] if masks is not None else [0] * len(opened)
        self._streams = [s if masks is None else open_split(s, split=split, mask=m) for s, m in zip(opened, masks or opened, strict=False)]
        self.num_sequences = [max(0, (s.num_tokens - 1) // seq_len) for s in self._streams]
        self._check_long_enough()
        self._counts = _block_counts([s.weight for s in data.streams], block=MIX_BLOCK)
        if only_stream is not None:  # one dataset of a mixture alone (its validation loss)
            self._counts = np.where(np.arange(len(self._counts)) == only_stream, MIX_BLOCK, 0)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def eos_id(self) -> int:
        """The end-of-document token between the packed documents."""
        return self.data.eos_id

    def _check_long_enough(self) -> None:
        if self.split == "val":
            problems = [
                Problem(
                    "data.val_fraction",
                    self.val_fraction,
                    f"holds out no documents of dataset {info.name!r}: too few documents, "
                    f"or too short for one sequence of model.seq_len + 1 = {self.seq_len + 1} tokens "
                    "(llmforge keys data.val_fraction says how they are chosen)",
                    "raise data.val_fraction, add documents, or set data.val_fraction=0",
                )
                for info, m in zip(self.data.streams, self.num_sequences, strict=False)
                if m == 0
            ]
            if problems:
                raise UserError(problems, title="not enough validation data")
        problems = [
            Problem(
                "model.seq_len",
                self.seq_len,
                f"dataset {info.name!r} has only {s.num_tokens} tokens, fewer than one sequence of seq_len + 1",
                "lower model.seq_len or add more text",
            )
            for info, s, m in zip(self.data.streams, self._streams, self.num_sequences, strict=False)
            if m == 0
        ]
        if problems:
            raise UserError(problems, title="not enough data")

    @property
    def epoch(self) -> int:
        """Completed passes over the first stream before the current position."""
        if len(self._counts) == 1:
            draws = self.position
        else:
            block, offset = divmod(self.position, MIX_BLOCK)
            labels, _ = self._block(block)
            draws = block * int(self._counts[0]) + int(np.count_nonzero(labels[:offset] == 0))
        return draws // self.num_sequences[0]

    def sequence_ids(self, *, start: int, count: int) -> np.ndarray:
        """[count, 3] int64 rows (stream, epoch, window) of global sequences start .. start+count-1."""
        g = np.arange(start, start + count, dtype=np.int64)
        stream, local = self._locate(g)
        out = np.empty((count, 3), dtype=np.int64)
        out[:, 0] = stream
        for s in np.unique(stream):
            mask = stream == s
            m = self.num_sequences[s]
            epoch, pos = np.divmod(local[mask], m)
            out[mask, 1] = epoch
            out[mask, 2] = self._windows(int(s), epoch, pos)
        return out

    def batch_ids(self, *, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """sequence_ids of one rank's rows of global batch number `step` (counted from position 0)."""
        rows = self._rows_per_rank(dp_size)
        return self.sequence_ids(start=step * self.global_batch_size + dp_rank * rows, count=rows)

    def next_batch(self, *, dp_rank: int, dp_size: int) -> torch.Tensor:
        """This rank's rows of the next global batch, shape [G/dp, seq_len+1]; advances by one global batch."""
        rows = self._rows_per_rank(dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        ids = self.sequence_ids(start=self.position + dp_rank * rows, count=rows)
        out = np.empty((rows, self.seq_len + 1), dtype=np.int64)
        span = self.seq_len + 1
        for row, (stream, _, window) in enumerate(ids):
            start = int(window) * self.seq_len
            out[row] = self._streams[stream].slice(start, start + span)
        if out.max() >= self._vocab_size:  # one pass over the batch (~2 us): a shard altered since it was written
            raise self._altered_shard(np.unique(ids[:, 0]))
        self.position += self.global_batch_size
        self.last_sequence_ids = ids
        return torch.from_numpy(out)

    def _altered_shard(self, streams: np.ndarray) -> UserError:
        """The shard holding an id past the tokenizer's vocabulary: its bytes are not those written."""
        for index in streams:
            found = self.data.open_stream(int(index)).find_id_at_least(self.data.vocab_size)
            if found is not None:
                path, largest = found
                return UserError(
                    [
                        Problem(
                            "",
                            "",
                            f"token shard {path} holds token id {largest}, but the tokenizer has "
                            f"{self.data.vocab_size} tokens: the prepared data was altered after it was written",
                            f"delete the cache folder {self.data.root} (or run `llmforge data prepare --force` "
                            "with the same settings) and start again",
                        )
                    ],
                    title="damaged data cache",
                )
        return UserError(
            f"a batch read from {self.data.root} holds a token id past the tokenizer's {self.data.vocab_size} "
            "tokens; delete that cache folder and start again",
            title="damaged data cache",
        )

    def _rows_per_rank(self, dp_size: int) -> int:
        if dp_size < 1 or self.global_batch_size % dp_size:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by dp size {dp_size}")
        return self.global_batch_size // dp_size

    def state_dict(self) -> dict:
        """Plain ints and strings: enough to continue the exact order."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "position": int(self.position),
            "epoch": self.epoch,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "data": self.data.fingerprint,
            "num_streams": len(self._streams),
            "split": self.split,
            "val_fraction": self.val_fraction,
            "val_seed": self.val_seed,
            "split_rule": SPLIT_RULE,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (the global batch size may differ; seq_len and data may not)."""
        if int(state.get("version", -1)) != STATE_VERSION:
            raise UserError(
                f"data sampler state has version {state.get('version')}, expected {STATE_VERSION}; "
                "the checkpoint was written by another llmforge version",
                title="incompatible checkpoint",
            )
        if int(state["seq_len"]) != self.seq_len:
            raise UserError(
                [
                    Problem(
                        "model.seq_len",
                        self.seq_len,
                        f"the checkpoint was trained with seq_len={state['seq_len']}",
                        f"resume with model.seq_len={state['seq_len']}",
                    )
                ],
                title="cannot resume the data order",
            )
        if state.get("data") != self.data.fingerprint or int(state.get("num_streams", 1)) != len(self._streams):
            raise UserError(
                "the prepared data differs from the data of the checkpoint (tokenizer or token shards "
                "changed); resume with the same data settings and files",
                title="cannot resume the data order",
            )
        self._check_split(state)
        self.seed = int(state["seed"])
        self.position = int(state["position"])
        self._perms.clear()
        self._blocks.clear()

    def _check_split(self, state: dict) -> None:
        """The held-out documents decide what the training order is drawn from: they must not change."""
        fraction, seed = float(state.get("val_fraction", 0.0)), int(state.get("val_seed", 0))
        problems = []
        if fraction != self.val_fraction:
            problems.append(
                Problem(
                    "data.val_fraction",
                    self.val_fraction,
                    f"the checkpoint was trained with data.val_fraction={fraction}",
                    f"resume with data.val_fraction={fraction}",
                )
            )
        elif fraction > 0 and seed != self.val_seed:
            problems.append(
                Problem(
                    "data.val_seed",
                    self.val_seed,
                    f"the checkpoint held out documents with data.val_seed={seed}",
                    f"resume with data.val_seed={seed}",
                )
            )
        elif fraction > 0 and int(state.get("split_rule", 1)) != SPLIT_RULE:
            problems.append(
                Problem(
                    "data.val_fraction",
                    self.val_fraction,
                    "the checkpoint chose its held-out documents by the rule of an "
                    "earlier llmforge version, and this one would train on some of them",
                    "resume with the llmforge version that wrote the checkpoint, or start a new run",
                )
            )
        if problems:
            raise UserError(problems, title="cannot resume the data order")

    def _locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, n-th draw from that stream) of global sequence numbers g."""
        if len(self._counts) == 1:
            return np.zeros_like(g), g
        block, offset = np.divmod(g, MIX_BLOCK)
        stream = np.empty_like(g)
        local = np.empty_like(g)
        for b in np.unique(block):
            labels, rank = self._block(int(b))
            mask = block == b
            stream[mask] = labels[offset[mask]]
            local[mask] = int(b) * self._counts[stream[mask]] + rank[offset[mask]]
        return stream, local

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if b not in self._blocks:
            if len(self._blocks) > 4:
                self._blocks.clear()
            labels = np.repeat(np.arange(len(self._counts)), self._counts)
            labels = np.random.default_rng([self.seed, 1, b]).permutation(labels)
            rank = np.empty(MIX_BLOCK, dtype=np.int64)
            for s in range(len(self._counts)):
                where = np.flatnonzero(labels == s)
                rank[where] = np.arange(len(where))
            self._blocks[b] = (labels, rank)
        return self._blocks[b]

    def _windows(self, stream: int, epochs: np.ndarray, pos: np.ndarray) -> np.ndarray:
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(stream, int(e))[pos[mask]]
        return out

    def _perm(self, stream: int, epoch: int) -> np.ndarray:
        key = (stream, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            rng = np.random.default_rng([self.seed, 0, stream, epoch])
            self._perms[key] = rng.permutation(self.num_sequences[stream])
        return self._perms[key]


def _block_counts(weights: list[float], *, block: int) -> np.ndarray:
    """Sequences per stream in every block: proportional to the weights, largest remainder, at least 1 each."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum() * block
    counts = np.maximum(np.floor(share).astype(np.int64), 1)
    while counts.sum() < block:
        counts[int(np.argmax(share - counts))] += 1
    while counts.sum() > block:
        counts[int(np.argmax(counts))] -= 1
    return counts
