"""Read a stream folder of token shards through np.memmap, without copying."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TokenStream:
    """The concatenated token shards of one stream, addressed by global token offset."""

    def __init__(self, folder: Path, *, shards: list[dict], dtype: str) -> None:
        self.folder = Path(folder)
        self.dtype = np.dtype(dtype)
        kept = [s for s in shards if s["tokens"] > 0]
        self._paths = [self.folder / s["file"] for s in kept]
        self._maps = [np.memmap(path, dtype=self.dtype, mode="r", shape=(s["tokens"],)) for path, s in zip(self._paths, kept, strict=False)]
        sizes = np.array([len(m) for m in self._maps], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop): a view into the memmap when inside one shard, else a joined copy."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        base = int(self._starts[shard])
        if stop <= int(self._starts[shard + 1]):
            return self._maps[shard][start - base : stop - base]
        parts = []
        while start < stop:
            base, end = int(self._starts[shard]), int(self._starts[shard + 1])
            take = min(stop, end)
            parts.append(self._maps[shard][start - base : take - base])
            start, shard = take, shard + 1
        return np.concatenate(parts)

    def doc_ends(self) -> np.ndarray:
        """End offset of every document (each document's last token is the end-of-document id)."""
        return np.load(self.folder / "doc_ends.npy", mmap_mode="r")

    def documents(self) -> list[np.ndarray]:
        """Every document's tokens, end-of-document token included (for checks and tests)."""
        ends = self.doc_ends()
        starts = np.concatenate([[0], ends[:-1]])
        return [self.slice(int(a), int(b)) for a, b in zip(starts, ends, strict=False)]

    def find_id_at_least(self, limit: int) -> tuple[Path, int] | None:
        """(shard file, its largest id) of the first shard holding an id >= limit, or None (error path only)."""
        for path, tokens in zip(self._paths, self._maps, strict=False):
            largest = int(tokens.max(initial=0))
            if largest >= limit:
                return path, largest
        return None
