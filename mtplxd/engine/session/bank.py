"""The session bank (RAM tier): a request restores the longest stored prefix of its prompt.

Coding agents resend the whole transcript every turn. After each request the bank keeps the
committed state under the exact token sequence it covers, and a later request whose prompt
starts with (part of) that sequence restores it and prefills only the rest.

What an entry holds (`BankEntry`), for tokens x_0..x_{S-1} fed to the trunk:
- attention KV of every full-attention trunk layer, copied to exactly S rows (KVCache
  buffers are preallocated in 256-token steps; a copy also keeps a stored entry from ever
  aliasing a live cache);
- for hybrid (Gated DeltaNet) families, the conv + recurrent state at a few *boundaries*:
  the end of each prefill chunk (newest `max_boundaries` kept), the end of the prompt and
  the end of the committed output. A recurrent state cannot be cut back, so a hybrid
  restore lands only on a stored boundary; dense models restore at any length;
- the MTP head's KV over the pairs (h_j, x_{j+1}) for j < head_len, plus the trunk hiddens
  h_head_len..h_{S-1} of the pairs not yet fed to the head (at most a verify block), so the
  speculative loop can rebuild its PENDING pairs at any restore point.

Exactness: a restore hands the engine the very arrays the earlier run computed for that prefix
(MLX arrays are immutable; restored caches write into new buffers). Where a matmul computes
each row alone (MLX's reference BLAS) those are a cold prefill's bits, and logits after a
restore equal a cold prefill's bitwise (tested per family); under OpenBLAS, whose kernels
depend on the matrix's shape, they equal it to float32 rounding and the tokens are the same.

Identity (`BankIdentity`): entries are only shared between requests with the same weights,
chat template and numerics (dtype/quantization, MLX version, device). Each entry also carries
the dtype its state was computed in (`BankEntry.dtype`, read from its own arrays, so an SSD
blob carries it in its tensor headers): an entry of another dtype than the running model's
(a bfloat16 state met by a float32 run on the Linux CPU) is refused as a miss, never cast.

Budget: a byte cap (LRU by session: the session used longest ago loses its oldest entry
first), an idle TTL and a per-session entry cap. `release_idle(n)` serves the memory guard.
The SSD tier (`store.SessionStore`) is optional: entries of at least
`ssd_min_tokens` tokens are written there off the request path and read back on a RAM miss.

Threading: everything that touches MLX runs on the model-owner thread. `bytes_held`,
`release_idle`, `stats` and `clear` may be called from any thread (a lock guards the maps;
dropping references from another thread only frees memory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from mtplxd.engine.model.kv_cache import BucketedKVCache
from mtplxd.engine.model.trunk import PrefillChunk, Trunk, run_steps
from mtplxd.engine.session.types import (
    ANONYMOUS, ATTENTION, GDN, KV, QKV, BankEntry, GDNState, RestorePlan, common_prefix, plan_restore,
)

if TYPE_CHECKING:
    from mtplxd.engine.model.mrope import RowPositions
    from mtplxd.engine.model.mtp_head import MTPHead
    from mtplxd.engine.session.store import SessionStore

log = logging.getLogger(__name__)

GIB = 1024**3
DEFAULT_RAM_BYTES = 2 * GIB
DEFAULT_IDLE_TTL_S = 3600.0
DEFAULT_MAX_BOUNDARIES = 8
DEFAULT_PER_SESSION_ENTRIES = 4
DEFAULT_SSD_MIN_TOKENS = 512
# Trunk hiddens kept for the head's not-yet-fed pairs; longer tails (a request that ended
# right after prefill) are not kept: such an entry then restores the head only up to head_len.
MAX_TAIL_HIDDEN_ROWS = 64
FORMAT_VERSION = 1


@dataclass(frozen=True)
class BankSettings:
    """Budgets of one bank. `ssd_dir` None keeps the bank in RAM only."""

    ram_bytes: int = DEFAULT_RAM_BYTES
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S
    per_session_entries: int = DEFAULT_PER_SESSION_ENTRIES
    max_boundaries: int = DEFAULT_MAX_BOUNDARIES
    ssd_dir: Path | None = None
    ssd_bytes: int = 32 * GIB
    ssd_min_tokens: int = DEFAULT_SSD_MIN_TOKENS


@dataclass(frozen=True)
class BankIdentity:
    """What must match for a stored state to be valid for a request (numerics included)."""

    model_path: str
    weights_fingerprint: str
    template_hash: str
    quantization: str | None
    dtype: str
    mlx_version: str
    mlx_lm_version: str
    device: str
    cache_dtype: str = ""  # the dtype the model computes and caches in (ModelInfo.dtype)
    kv_bits: int = 0  # attention KV quantization (an 8-bit entry cannot resume a 4-bit cache)
    format_version: int = FORMAT_VERSION

    @property
    def key(self) -> str:
        """A stable hex digest of every field (the SSD manifest's identity column)."""
        text = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


# Files whose settings shape a stored state: the model's config and, for a vision checkpoint,
# the image processor's (its pixel limits set an image's grid, so its rows and positions).
FINGERPRINTED_CONFIGS = ("config.json", "preprocessor_config.json", "processor_config.json")


def weights_fingerprint(path: str | Path) -> str:
    """sha256 over the bytes of config.json (and the image processor's configs, when
    present) and the name, size and mtime of every weight file."""
    path = Path(path)
    digest = hashlib.sha256()
    for name in FINGERPRINTED_CONFIGS:
        config = path / name
        if config.is_file():
            digest.update(config.read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def identity_for(info: Any, tokenizer: Any, model: Any) -> BankIdentity:
    """The identity of a loaded model (`info`: ModelInfo; `model`: the mlx-lm module)."""
    import mlx_lm

    template = getattr(tokenizer, "chat_template", None) or ""
    dtypes = sorted({str(v.dtype) for _, v in _first_params(model)})
    return BankIdentity(
        model_path=str(info.path),
        weights_fingerprint=weights_fingerprint(info.path),
        template_hash=hashlib.sha256(str(template).encode()).hexdigest(),
        quantization=info.quantization,
        dtype=",".join(dtypes),
        mlx_version=mx.__version__,
        mlx_lm_version=getattr(mlx_lm, "__version__", "?"),
        device=str(mx.default_device()),
        cache_dtype=str(getattr(info, "dtype", "")),
        kv_bits=int(getattr(info, "kv_bits", 0)),
    )


def _first_params(model: Any, limit: int = 16) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())[:limit]


def _copy_rows(x: mx.array, axis: int, n: int) -> mx.array:
    """A new array holding the first n entries of `x` along `axis`: bit-exact, and never a
    view that would keep a larger preallocated buffer alive (or alias a live cache).

    Where the first n rows are not one contiguous run of `x` (some dimension before `axis`
    is larger than 1 and n is short of the whole axis: a KV cache's (1, H, S, D) buffer with
    H > 1), `mx.contiguous` of the slice must copy them into a buffer of their own: a plain
    copy, about 7x faster than a gather over a 16k-token cache. Where the slice would be a
    contiguous run (`mx.contiguous` would then share `x`'s buffer), a gather copies it."""
    index = (slice(None),) * axis + (slice(0, n),)
    if n < x.shape[axis] and math.prod(x.shape[:axis]) > 1:
        return mx.contiguous(x[index])
    return mx.take(x, mx.arange(n), axis=axis)


def cache_kinds(cache: list[Any]) -> tuple[str, ...] | None:
    """KV/QKV/GDN per trunk layer, or None when some layer's cache cannot be banked
    (rotating or other caches)."""
    kinds = []
    for c in cache:
        # BucketedKVCache (CUDA's fixed verify shapes) keeps KVCache's fields and semantics.
        if type(c) in (KVCache, BucketedKVCache):
            kinds.append(KV)
        elif type(c) is QuantizedKVCache:  # kv_bits: keys and values are (data, scales, biases)
            kinds.append(QKV)
        elif isinstance(c, ArraysCache) and len(c.cache) == 2:
            kinds.append(GDN)
        else:
            return None
    return tuple(kinds)


def gdn_state(cache: list[Any], kinds: tuple[str, ...]) -> GDNState:
    """A copy of the conv state and a reference to the (immutable) recurrent state of each
    GDN layer. The conv state is copied because mlx-lm's may be a view of a whole chunk."""
    state = []
    for c, kind in zip(cache, kinds):
        if kind == GDN:
            conv = c.cache[0]
            conv = _copy_rows(conv, 1, conv.shape[1]) if conv is not None else None
            state.append((conv, c.cache[1]))
    return state


def _positions_continue(entry: BankEntry, matched: int, positions: "RowPositions | None") -> bool:
    """False when a prompt that runs through the whole entry would place the token after it
    elsewhere than the entry's own positions do (index + entry.rope_delta): the image rows'
    (t, h, w) positions are a function of the image bytes the key already names, so this only
    guards the rule, never a regular restore."""
    if matched < entry.length:
        return True
    expected = positions.delta_at(entry.length) if positions is not None else 0
    return expected is None or expected == entry.rope_delta


# --- one request's view of the bank ------------------------------------------------------


class BankTurn:
    """A request's restored state and what it must record for the bank afterwards.

    Created by `SessionBank.begin`. `cache` (and `head_cache`, when the request speculates)
    are ready to use; `cached` prompt tokens are already in them.
    """

    def __init__(self, bank: "SessionBank", trunk: Trunk, prompt: list[int], session_id: str,
                 kinds: tuple[str, ...] | None, cache: list[Any], head_cache: list[Any] | None,
                 plan: RestorePlan | None, source: BankEntry | None,
                 key: list[int] | None = None, rope_delta: int = 0) -> None:
        self.bank, self.trunk, self.prompt, self.session_id = bank, trunk, prompt, session_id
        self.rope_delta = rope_delta  # the prompt's (mRoPE); stored with the entry
        # What entries are matched and stored under: the prompt, with image rows replaced by
        # values derived from the image bytes (vision.bank_key).
        self.key = prompt if key is None else key
        self.kinds, self.cache, self.head_cache = kinds, cache, head_cache
        self.cached = plan.trunk_len if plan else 0
        # Where the restored prefix came from, for the request's stats: cold | ram | ssd.
        self.restored_from = "cold" if not self.cached else "ram"
        self.pending_from = plan.head_len if plan else 0
        self.boundaries: dict[int, GDNState] = {}
        if source is not None and plan is not None and source.hybrid:
            matched = common_prefix(source.tokens, self.key)
            self.boundaries = {b: s for b, s in source.boundaries.items() if b <= matched}
        self.restored_hidden: mx.array | None = None
        if head_cache is not None and plan is not None and source is not None \
                and plan.head_len < plan.trunk_len:
            start = plan.head_len - source.head_len
            rows = plan.trunk_len - plan.head_len
            self.restored_hidden = source.tail_hidden[:, start:start + rows]

    @property
    def hybrid(self) -> bool:
        return self.kinds is not None and GDN in self.kinds

    def prefill(self, chunk_size: int, *, should_stop: Callable[[], bool] | None = None
                ) -> tuple[list[mx.array], mx.array] | None:
        """Prefill prompt[cached:] in `chunk_size` pieces as `Trunk.prefill` does, recording
        hybrid boundaries; returns (hiddens from position `pending_from` on, last logits).

        Hybrid models also end a forward one token before the prompt's end, so that a resent
        prompt (stop-and-resend, regenerate) restores all but its last token. Returns None
        when `should_stop()` turns True between two forwards (nothing is stored then)."""
        return run_steps(self.prefill_steps(chunk_size, should_stop=should_stop))

    def prefill_steps(self, chunk_size: int, *, should_stop: Callable[[], bool] | None = None,
                      embeddings: mx.array | None = None,
                      ) -> Generator[PrefillChunk, Any, tuple[list[mx.array], mx.array] | None]:
        """`prefill` one forward per step, each a PrefillChunk to be answered, None between
        two (as Trunk.prefill_steps), for the scheduler. `embeddings`: the whole prompt's
        input embeddings (images spliced in), or None."""
        rest = self.prompt[self.cached:]
        ends = list(range(chunk_size, len(rest), chunk_size)) + [len(rest)]
        if self.hybrid and len(rest) > 1 and len(rest) - 1 not in ends:
            ends.insert(-1, len(rest) - 1)
        hiddens: list[mx.array] = []
        logits = None
        start = 0
        for end in ends:
            if start:
                yield None
                if should_stop is not None and should_stop():
                    return None
            chunk = mx.array(rest[start:end])[None]
            rows = None if embeddings is None else \
                embeddings[:, self.cached + start:self.cached + end]
            hidden, logits = yield PrefillChunk(self.trunk, chunk, self.cache, rows,
                                                position=self.cached + start)
            if hidden is not None:
                hiddens.append(hidden)
            if self.hybrid:
                self.boundaries[self.cached + end] = gdn_state(self.cache, self.kinds)
            start = end
        assert logits is not None, "empty prompt"
        if self.restored_hidden is not None:
            hiddens.insert(0, self.restored_hidden)
        return hiddens, logits[0, -1]

    def store(self, produced: list[int], head_cache: list[Any] | None,
              pending_hidden: mx.array | None, returned: int | None = None) -> None:
        """Keep the committed state: the trunk cache holds a prefix of prompt + produced
        (the tokens the decoder committed, a final stop token included); `head_cache` and
        `pending_hidden` (hiddens of the head's unfed pairs) come from the speculative
        decoder, None for AR. `returned`: how many of `produced` the request returned (a
        cycle that reached the cap or a stop token may have committed more)."""
        if self.kinds is None:
            return
        try:
            self.bank.store_turn(self, produced, head_cache, pending_hidden, returned)
        except Exception:  # the bank is an optimisation: never fail a finished request
            log.exception("session bank: could not store the turn")


# --- the bank ----------------------------------------------------------------------------


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    expired: int = 0
    superseded: int = 0
    oversized_skipped: int = 0
    ssd_hits: int = 0


class SessionBank:
    """RAM bank of committed states keyed by exact token prefix (see the module docstring)."""

    def __init__(self, identity: BankIdentity, settings: BankSettings | None = None, *,
                 store: "SessionStore | None" = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = identity
        self.settings = settings or BankSettings()
        self.clock = clock
        self._entries: dict[tuple[int, ...], BankEntry] = {}
        self._lock = threading.RLock()
        self.counters = _Counters()
        self.store = store
        self.ssd_error: str | None = None  # why the SSD tier could not open, when it could not
        if store is None and self.settings.ssd_dir is not None:
            self.store = self._open_store(self.settings.ssd_dir)

    def _open_store(self, ssd_dir: Path) -> "SessionStore | None":
        """The SSD tier, or None (RAM only, the reason kept) when its folder cannot be used even
        after a damaged store was moved aside: the bank is a cache and never fatal."""
        import sqlite3

        from mtplxd.engine.session.store import SessionStore

        try:
            return SessionStore(ssd_dir, max_bytes=self.settings.ssd_bytes)
        except (OSError, sqlite3.Error) as exc:
            self.ssd_error = f"{type(exc).__name__}: {exc}"
            log.warning("session bank: the SSD tier at %s cannot be used (%s); RAM only",
                        ssd_dir, self.ssd_error)
            return None

    def health_note(self) -> str | None:
        """One sentence when the SSD tier is degraded (moved aside or off), else None; cheap,
        for /health and status."""
        if self.ssd_error is not None:
            return (f"the session bank's SSD tier is off: {self.ssd_error}; check the folder "
                    f"{self.settings.ssd_dir}")
        quarantined = self.store.quarantined if self.store is not None else None
        if quarantined:
            return (f"the session bank's SSD store was damaged ({quarantined['reason']}); it was "
                    f"moved aside to {quarantined['path']} and started empty (delete that folder "
                    "to free its space)")
        return None

    # -- guard and status (any thread) ----------------------------------------------------

    def bytes_held(self) -> int:
        """Bytes of MLX arrays the RAM tier holds."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def release_idle(self, needed_bytes: int) -> int:
        """Drop least-recently-used entries until `needed_bytes` are freed (or none is left);
        returns the bytes freed. Entries also on SSD stay restorable from there."""
        freed = 0
        with self._lock:
            while freed < needed_bytes and self._entries:
                freed += self._evict_one()
        # No mx.clear_cache() here: this may run off the owner thread; MLX reuses the freed
        # buffers for the next request, and generate() clears the cache after each request.
        return freed

    def clear(self) -> int:
        """Drop every RAM entry; returns the bytes freed."""
        return self.release_idle(1 << 62)

    def stats(self) -> dict[str, Any]:
        """entries, bytes, hits, misses, hit_rate, cached/prompt tokens, evictions, ssd_*."""
        with self._lock:
            self._expire()
            c = self.counters
            looked = c.hits + c.misses
            out = {
                "entries": len(self._entries),
                "bytes": sum(e.nbytes for e in self._entries.values()),
                "cap_bytes": self.settings.ram_bytes,
                "sessions": len({e.session_id for e in self._entries.values()}),
                "hits": c.hits,
                "misses": c.misses,
                "hit_rate": c.hits / looked if looked else 0.0,
                "cached_tokens": c.cached_tokens,
                "prompt_tokens": c.prompt_tokens,
                "stored": c.stored,
                "evicted": c.evicted,
                "expired": c.expired,
                "superseded": c.superseded,
                "oversized_skipped": c.oversized_skipped,
                "ssd_hits": c.ssd_hits,
            }
        if self.store is not None:
            out.update({f"ssd_{k}": v for k, v in self.store.stats().items()})
        else:
            out.update({"ssd_enabled": False, "ssd_entries": 0, "ssd_bytes": 0,
                        "ssd_error": self.ssd_error})
        out["note"] = self.health_note()
        return out

    def close(self) -> None:
        """Finish pending SSD writes and close the SSD tier."""
        if self.store is not None:
            self.store.close()

    # -- requests (owner thread) ----------------------------------------------------------

    def begin(self, trunk: Trunk, head: "MTPHead | None", prompt: list[int],
              session_id: str | None = None, key: list[int] | None = None,
              positions: "RowPositions | None" = None) -> BankTurn:
        """Restore the longest usable stored prefix of `prompt` into fresh caches.

        `head` is the MTP head when the request speculates (its cache is restored too),
        None for AR. `key` is what entries are matched and stored under when it is not the
        prompt itself (a prompt with images: vision.bank_key), and `positions` the prompt's
        multimodal rotary positions (its rope_delta is stored with the entry; an entry is only
        restored whole where the prompt continues at the entry's rope_delta). Never raises
        for a miss: the turn then starts from empty caches.
        """
        session = session_id or ANONYMOUS
        fed = prompt
        prompt = fed if key is None else key
        cache = trunk.make_cache()
        kinds = cache_kinds(cache)
        head_cache = trunk.make_head_cache(head) if head is not None else None
        rope_delta = positions.rope_delta if positions is not None else 0
        if kinds is None:
            return BankTurn(self, trunk, fed, session, None, cache, head_cache, None, None, prompt,
                            rope_delta)
        need_head = head is not None
        with self._lock:
            self._expire()
            self.counters.prompt_tokens += len(prompt)
            entry, plan = self._best_ram(prompt, need_head, session, positions)
        ram_entry = entry
        entry, plan = self._maybe_ssd(prompt, need_head, session, entry, plan, kinds, positions)
        if entry is None or plan is None:
            self.counters.misses += 1
            return BankTurn(self, trunk, fed, session, kinds, cache, head_cache, None, None, prompt,
                            rope_delta)
        with self._lock:
            entry.hits += 1
            entry.last_used = self.clock()
            self.counters.hits += 1
            self.counters.cached_tokens += plan.trunk_len
        self._install(entry, plan, cache, head_cache)
        turn = BankTurn(self, trunk, fed, session, kinds, cache, head_cache, plan, entry, prompt,
                        rope_delta)
        if entry is not ram_entry and turn.cached:
            turn.restored_from = "ssd"
        return turn

    def _best_ram(self, prompt: list[int], need_head: bool, session: str,
                  positions: "RowPositions | None") -> tuple[BankEntry | None, RestorePlan | None]:
        best: tuple[tuple, BankEntry, RestorePlan] | None = None
        for entry in self._entries.values():
            plan = self._plan(entry, prompt, need_head, positions)
            if plan is None:
                continue
            rank = (plan.trunk_len, entry.session_id == session, entry.last_used)
            if best is None or rank > best[0]:
                best = (rank, entry, plan)
        return (best[1], best[2]) if best else (None, None)

    def _plan(self, entry: BankEntry, prompt: list[int], need_head: bool,
              positions: "RowPositions | None" = None) -> RestorePlan | None:
        if need_head and entry.head_kv is None:
            return None
        if self.identity.cache_dtype and entry.dtype not in (None, self.identity.cache_dtype):
            # Restoring it would mix dtypes into the cache: output no cold run produces.
            return None
        matched = common_prefix(entry.tokens, prompt)
        if not _positions_continue(entry, matched, positions):
            return None
        tail = entry.tail_hidden.shape[1] if entry.tail_hidden is not None else 0
        boundaries = sorted(entry.boundaries) if entry.hybrid else None
        return plan_restore(entry.length, boundaries, entry.head_len, tail,
                            matched, len(prompt), need_head)

    def _maybe_ssd(self, prompt, need_head, session, entry, plan, kinds, positions=None):
        """Load a deeper match from the SSD tier (if any) into RAM."""
        if self.store is None:
            return entry, plan
        have = plan.trunk_len if plan else 0
        found = self.store.best_match(self.identity.key, prompt, need_head, have)
        if found is None:
            return entry, plan
        loaded = self.store.load(found, kinds)
        if loaded is None:
            return entry, plan
        loaded.session_id = session
        loaded.last_used = self.clock()
        loaded.on_ssd = True
        loaded_plan = self._plan(loaded, prompt, need_head, positions)
        if loaded_plan is None or loaded_plan.trunk_len <= have:
            return entry, plan
        self.counters.ssd_hits += 1
        with self._lock:
            self._insert(loaded)
        return loaded, loaded_plan

    def _install(self, entry: BankEntry, plan: RestorePlan, cache: list[Any],
                 head_cache: list[Any] | None) -> None:
        r = plan.trunk_len
        state = entry.boundaries.get(r) if entry.hybrid else None
        gdn = iter(state or [])
        for c, kind, pair in zip(cache, entry.kinds, entry.kv):
            if kind == KV:
                c.keys, c.values = pair[0][:, :, :r, :], pair[1][:, :, :r, :]
                c.offset = r
            elif kind == QKV:
                c.keys, c.values = (tuple(a[:, :, :r, :] for a in side) for side in pair)
                c.offset = r
            else:
                conv, rec = next(gdn)
                c.cache[0], c.cache[1] = conv, rec
        if head_cache is not None:
            p = plan.head_len
            if p > 0:
                head_cache[0].keys = entry.head_kv[0][:, :, :p, :]
                head_cache[0].values = entry.head_kv[1][:, :, :p, :]
                head_cache[0].offset = p

    def store_turn(self, turn: BankTurn, produced: list[int], head_cache: list[Any] | None,
                   pending_hidden: mx.array | None, returned: int | None = None) -> None:
        """Build an entry from a finished request's caches and insert it (see BankTurn.store).

        A dense model's entry ends with the tokens the request returned: tokens the last
        cycle committed past the cap or a stop token are in no later prompt, so an entry
        holding them would never be an exact prefix of the next turn's, and each turn of a
        conversation would leave one such entry behind instead of superseding it. A hybrid's
        recurrent state cannot be cut back, so its entry keeps every committed token."""
        cache, kinds = turn.cache, turn.kinds
        committed = next(c.offset for c, k in zip(cache, kinds) if k in ATTENTION)
        kept = produced if turn.hybrid or returned is None else produced[:returned]
        length = min(committed, len(turn.key) + len(kept))
        tokens = tuple((turn.key + kept)[:length])
        if len(tokens) != length or length == 0:
            return
        boundaries = dict(turn.boundaries)
        if turn.hybrid:
            boundaries[length] = gdn_state(cache, kinds)
            prompt_end = len(turn.key)
            boundaries = self._thin(boundaries, keep={prompt_end - 1, prompt_end, length})
        head = head_cache[0] if head_cache is not None and head_cache[0].keys is not None else None
        # The head's pair j reads token j + 1: a cut entry keeps the pairs within it.
        head_len = 0 if head is None else \
            head.offset if length == committed else min(head.offset, length - 1)
        # A resent or regenerated turn usually ends where a stored entry already reaches: that
        # entry then takes this turn's boundaries (as `insert` would) and the KV is not copied
        # at all. The copy is the whole conversation's state (0.4 s for a 16k-token prompt of
        # the embedded model) and it runs before the model thread admits the next request.
        if self._absorb_if_covered(tokens, head is not None, head_len, boundaries):
            return
        kv: list[tuple[mx.array, mx.array] | None] = []
        for c, kind in zip(cache, kinds):
            if kind == KV:
                kv.append((_copy_rows(c.keys, 2, length), _copy_rows(c.values, 2, length)))
            elif kind == QKV:
                kv.append(tuple(tuple(_copy_rows(a, 2, length) for a in side) for side in (c.keys, c.values)))
            else:
                kv.append(None)
        entry = BankEntry(tokens=tokens, kinds=kinds, kv=kv, boundaries=boundaries,
                          session_id=turn.session_id, last_used=self.clock(),
                          rope_delta=turn.rope_delta)
        if head is not None:
            entry.head_len = head_len
            entry.head_kv = (_copy_rows(head.keys, 2, entry.head_len),
                             _copy_rows(head.values, 2, entry.head_len))
            if length == committed and pending_hidden is not None \
                    and pending_hidden.shape[1] == length - head.offset \
                    and pending_hidden.shape[1] <= MAX_TAIL_HIDDEN_ROWS:
                entry.tail_hidden = _copy_rows(pending_hidden, 1, pending_hidden.shape[1])
        mx.eval(entry.arrays())
        entry.compute_nbytes()
        self.insert(entry)

    def _thin(self, boundaries: dict[int, GDNState], keep: set[int]) -> dict[int, GDNState]:
        """Keep the pinned boundaries plus the newest `max_boundaries` others (a diverging
        turn usually diverges near the end of the transcript)."""
        others = sorted((b for b in boundaries if b not in keep), reverse=True)
        kept = set(others[: self.settings.max_boundaries]) | (keep & boundaries.keys())
        return {b: boundaries[b] for b in sorted(kept)}

    def insert(self, entry: BankEntry) -> None:
        """Add a complete entry (owner thread): supersede entries it extends, enforce the
        budgets, and queue it for the SSD tier when long enough."""
        if entry.nbytes > self.settings.ram_bytes:
            self.counters.oversized_skipped += 1
            self._to_ssd(entry)
            return
        with self._lock:
            if self._covered(entry):
                return
            self._insert(entry)
            self.counters.stored += 1
        self._to_ssd(entry)

    def _covered(self, entry: BankEntry) -> bool:
        """True when an existing entry already extends `entry` with at least its head state;
        its boundaries are merged into that entry instead."""
        other = self._covering(entry.tokens, entry.head_kv is not None, entry.head_len)
        if other is None:
            return False
        self._absorb(other, entry.boundaries, entry.last_used)
        return True

    def _covering(self, tokens: tuple[int, ...], has_head: bool, head_len: int) -> BankEntry | None:
        """The entry that extends `tokens` with at least that head state, or None."""
        n = len(tokens)
        for other in self._entries.values():
            if other.length >= n and other.tokens[:n] == tokens \
                    and (other.head_kv is not None or not has_head) \
                    and other.head_len >= min(head_len, other.length):
                return other
        return None

    def _absorb(self, other: BankEntry, boundaries: dict[int, GDNState], last_used: float) -> None:
        for b, state in boundaries.items():
            other.boundaries.setdefault(b, state)
        other.last_used = max(other.last_used, last_used)
        other.compute_nbytes()
        self._enforce_budget()

    def _absorb_if_covered(self, tokens: tuple[int, ...], has_head: bool, head_len: int,
                           boundaries: dict[int, GDNState]) -> bool:
        """`insert`'s `_covered` for a turn not yet copied into an entry (owner thread): True
        when a stored entry covers it and took its boundaries."""
        with self._lock:
            other = self._covering(tokens, has_head, head_len)
            if other is None:
                return False
            fresh = [a for b, state in boundaries.items() if b not in other.boundaries
                     for pair in state for a in pair if a is not None]
            mx.eval(fresh)  # the merged states are kept: computed now, as store_turn's are
            self._absorb(other, boundaries, self.clock())
            return True

    def _insert(self, entry: BankEntry) -> None:
        # Entries whose tokens `entry` extends are superseded; their boundaries live on in it.
        for key, other in list(self._entries.items()):
            if other.length < entry.length and entry.tokens[:other.length] == other.tokens \
                    and (entry.head_kv is not None or other.head_kv is None):
                for b, state in other.boundaries.items():
                    entry.boundaries.setdefault(b, state)
                del self._entries[key]
                self.counters.superseded += 1
        if entry.hybrid:
            entry.boundaries = self._thin(entry.boundaries, keep={entry.length})
        entry.compute_nbytes()
        self._entries[entry.tokens] = entry
        self._enforce_budget(protect=entry)

    def _to_ssd(self, entry: BankEntry) -> None:
        if self.store is None or entry.on_ssd or entry.length < self.settings.ssd_min_tokens:
            return
        entry.on_ssd = True
        self.store.put(self.identity.key, entry)

    def _enforce_budget(self, protect: BankEntry | None = None) -> None:
        self._expire()
        by_session: dict[str, list[BankEntry]] = {}
        for e in self._entries.values():
            by_session.setdefault(e.session_id, []).append(e)
        for session, entries in by_session.items():
            if session == ANONYMOUS:
                continue
            entries.sort(key=lambda e: e.last_used)
            for e in entries[: max(0, len(entries) - self.settings.per_session_entries)]:
                if e is not protect:
                    self._drop(e)
                    self.counters.evicted += 1
        while sum(e.nbytes for e in self._entries.values()) > self.settings.ram_bytes:
            if self._evict_one(protect) == 0:
                break

    def _evict_one(self, protect: BankEntry | None = None) -> int:
        """Drop the oldest entry of the session used longest ago; returns its bytes."""
        last_use: dict[str, float] = {}
        for e in self._entries.values():
            last_use[e.session_id] = max(last_use.get(e.session_id, 0.0), e.last_used)
        candidates = [e for e in self._entries.values() if e is not protect]
        if not candidates:
            return 0
        victim = min(candidates, key=lambda e: (last_use[e.session_id], e.last_used))
        self._drop(victim)
        self.counters.evicted += 1
        return victim.nbytes

    def _expire(self) -> None:
        now = self.clock()
        for e in list(self._entries.values()):
            if now - e.last_used > self.settings.idle_ttl_s:
                self._drop(e)
                self.counters.expired += 1

    def _drop(self, entry: BankEntry) -> None:
        self._entries.pop(entry.tokens, None)

    def entries(self) -> list[BankEntry]:
        """The RAM entries, newest first (inspection and tests)."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)


def bank_settings(ram: str | float, ssd_enabled: bool, ssd_dir: Path, ssd: str | float = "auto",
                  *, limit_bytes: int | None = None, weights_bytes: int | None = None
                  ) -> BankSettings | None:
    """Settings from the config keys `session_bank_bytes`, `session_bank_ssd`,
    `session_bank_ssd_bytes` (GiB or "auto"); None when the bank is off (0 GiB).

    RAM "auto": a quarter of what the memory limit leaves after the weights (1 to 48 GiB,
    never more than half of it: a bank past the limit would only be shed again by every
    request) when the memory guard's limit is known, else 2 GiB. SSD "auto": 32 GiB (the
    store also never takes more than half the free disk).
    """
    if ram == "auto":
        if limit_bytes is not None and weights_bytes is not None:
            room = max(limit_bytes - weights_bytes, 0)
            ram_bytes = int(min(max(room // 4, GIB), 48 * GIB, room // 2))
        else:
            ram_bytes = DEFAULT_RAM_BYTES
    else:
        ram_bytes = int(float(ram) * GIB)
    if ram_bytes <= 0:
        return None
    ssd_bytes = 32 * GIB if ssd == "auto" else int(float(ssd) * GIB)
    use_ssd = ssd_enabled and ssd_bytes > 0
    return BankSettings(ram_bytes=ram_bytes, ssd_dir=Path(ssd_dir) if use_ssd else None,
                        ssd_bytes=ssd_bytes)
