"""The engine model: a continuous-batching scheduler stepping in simulated time.

One job, hence its length: the scheduler's step (admission, KV blocks, preemption, prefix cache,
speculative decoding) and nothing of HTTP or clocks.

It mirrors vLLM V1's scheduler closely enough that a load generator sees the same effects:

- KV cache in blocks of ``block_size`` tokens; ``num_gpu_blocks - 1`` usable (vLLM keeps a null
  block). Blocks are allocated step by step for the tokens computed (prompt, then output), not
  reserved for max_tokens up front, exactly like vLLM; so a batch that outgrows the cache
  preempts: the most recently admitted running request loses its blocks and goes back to the
  front of the waiting queue, to be recomputed later (its streamed tokens are not resent).
- Admission is FCFS while ``max_num_seqs`` and free blocks allow; the head of the queue blocks
  the rest (no skipping), as vLLM does.
- Chunked prefill: every step has a token budget (``max_num_batched_tokens``); running requests
  go first (a decode costs 1 + k speculative tokens), then waiting ones take chunks.
- Prefix cache keyed by whole prompt blocks: a chain hash of (parent, block tokens, cache_salt).
  Freed blocks keep their hash until the allocator reuses them (LRU), so a repeated prompt skips
  its cached blocks; at least one token is always recomputed (vLLM caps hits at len - 1).
- Step time from the profile: decode cost of the batch plus P(b) - P(a) for each prefill chunk.
- Speculative decoding: each decode proposes k tokens and emits 1 + accepted tokens (several
  tokens per chunk). Acceptance belongs to the request, as on real hardware where the prompt's
  content decides it: a request draws its acceptance length once, seeded from its prompt's
  tokens (profile ``acceptance_length``: mean by context, spread), or takes its calibrated
  cell's value (the cell found from its prompt length and the number of requests the engine
  holds). Each step then draws from the profile's per-position shape scaled to that length,
  with a golden-ratio (Weyl) sequence instead of independent uniforms: the steps of one request
  average to its acceptance within a fraction of a percent after a few hundred steps, so the
  scatter between cells is the per-request draw's, not sampling noise of the steps.
- An API-server front end delays each request before the engine sees it (profile.frontend),
  and may hold a computed first token before sending it (``first_token_output``: the request
  decodes only once its first token is out).

The engine is a pure state machine over a simulated clock (no asyncio): ``add``, ``abort``,
``next_event_time`` and ``advance(until)``. The HTTP server drives it against the wall clock;
``predict`` drives it directly. Every request keeps its ground truth: arrival, admission, token
emission times (one entry per token, simulated seconds), preemptions and the finish.
"""

from __future__ import annotations

import heapq
import random
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from speedmatrix.sim.profile import Profile

FRONTEND, FRONTEND2, WAITING, RUNNING, FINISHED = range(5)
GOLDEN = 0.6180339887498949
"""Step of the Weyl sequence of a request's per-step acceptance draws (low discrepancy)."""


def prompt_key(prompt: list[int]) -> int:
    """A stable hash of a prompt's tokens (the same in every process, unlike hash() of str)."""
    return zlib.crc32(array("q", prompt).tobytes())


STATE_NAMES = ("frontend", "frontend", "waiting", "running", "finished")


@dataclass(eq=False, slots=True)
class Request:
    """One request and, as it runs, the ground truth of what the engine did with it.

    Per-token and per-step records are arrays, not lists of objects: thousands of finished
    requests are kept for ground truth, and arrays are invisible to the garbage collector (a
    full collection over lists of floats would stall the server's event loop).
    """

    rid: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    plen: int = 0  # len(prompt), set on arrival (hot path)
    target: int = 0  # tokens it will really produce (max_tokens, possibly cut short)
    finish_on_target: str = "length"
    index: int = 0
    state: int = FRONTEND
    arrival: float = 0.0
    ready: float | None = None  # front end done, engine sees it
    first_scheduled: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None  # length, stop, abort
    num_computed: int = 0
    out: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    token_times: array = field(default_factory=lambda: array("d"))  # one entry per token
    accepted: array = field(default_factory=lambda: array("i"))  # spec: accepted per decode step
    acc_len: float = 0.0  # spec: the request's drawn mean acceptance length
    pkey: int = 0  # spec: hash of the prompt's tokens (seeds the draw, ranks a cell's streams)
    cell_ctx: int | None = None  # spec: the calibrated cell context its prompt belongs to
    weyl: float = 0.0  # spec: state of the per-step quasi-random draw
    held_first: int = 0  # >0: its first token is computed and held until an output event
    waiter: object | None = None  # set by the server: woken when tokens arrive
    chunk_times: array = field(default_factory=lambda: array("d"))  # server: chunk written (sim s)
    chunk_tokens: array = field(default_factory=lambda: array("i"))  # server: tokens in it
    fault_disconnect: int | None = None  # server: drop the stream after this many tokens
    fault_repeat: bool = False  # server: the text is a repetition loop
    # server: the text is these prompt ids (the request's own), from their start (kept apart
    # from `prompt`, which the engine drops when the request finishes)
    fault_echo: list[int] | None = None

    @property
    def steps(self) -> list[tuple[float, int]]:
        """(time, tokens) of each step that emitted tokens: tokens of one step share a time."""
        out: list[tuple[float, int]] = []
        for t in self.token_times:
            if out and out[-1][0] == t:
                out[-1] = (t, out[-1][1] + 1)
            else:
                out.append((t, 1))
        return out

    @property
    def chunks(self) -> list[tuple[float, int]]:
        return list(zip(self.chunk_times, self.chunk_tokens, strict=True))

    @property
    def prompt_len(self) -> int:
        return self.plen or len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    def ground_truth(self) -> dict[str, object]:
        ttft = self.token_times[0] - self.arrival if self.token_times else None
        tbt = None
        if len(self.token_times) > 1:
            tbt = (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)
        return {
            "id": self.rid,
            "index": self.index,
            "state": STATE_NAMES[self.state],
            "prompt_tokens": self.prompt_len,
            "max_tokens": self.max_tokens,
            "target_tokens": self.target,
            "output_tokens": self.out,
            "cached_tokens": self.cached_tokens,
            "arrival": self.arrival,
            "ready": self.ready,
            "first_scheduled": self.first_scheduled,
            "first_token": self.token_times[0] if self.token_times else None,
            "finished_at": self.finished_at,
            "finish_reason": self.finish_reason,
            "preemptions": self.preemptions,
            "ttft_s": ttft,
            "tbt_s": tbt,
            "token_times": list(self.token_times),
            "steps": [list(s) for s in self.steps],
            "accepted": list(self.accepted),
            "acceptance_length": self.acc_len or None,
            "chunks": [list(c) for c in self.chunks],
        }


class BlockPool:
    """KV blocks with reference counts and an LRU of free-but-cached blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_q: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def free(self) -> int:
        return len(self.free_q)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_q)

    def lookup(self, hashes: list[int], limit: int) -> list[int]:
        hit = []
        cached = self.cached
        for h in hashes[:limit]:
            b = cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free_q[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n == 1 and self.hash_of[next(iter(self.free_q))] is None:
            b, _ = self.free_q.popitem(last=False)  # the common decode case: one fresh block
            self.ref[b] = 1
            return [b]
        out = []
        for _ in range(n):
            b, _ = self.free_q.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evict: the block is reused for other tokens
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Reverse order: the tail of a prompt is evicted before its head (as vLLM does).
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_q[b] = None

    def register(self, block: int, h: int) -> None:
        if self.hash_of[block] is None and h not in self.cached:
            self.hash_of[block] = h
            self.cached[h] = block


def _cell_ranks(plan: list[tuple[Request, int, bool]]) -> dict[Request, tuple[int, int]]:
    """(rank, count) of each decoding request among those of its cell context, by prompt hash:
    a stable order of a cell's streams (each keeps its prompt, so its place, across restarts)."""
    groups: dict[int | None, list[Request]] = {}
    for r, _, decode in plan:
        if decode:
            groups.setdefault(r.cell_ctx, []).append(r)
    out: dict[Request, tuple[int, int]] = {}
    for members in groups.values():
        members.sort(key=lambda r: (r.pkey, r.index))
        for j, r in enumerate(members):
            out[r] = (j, len(members))
    return out


def block_hashes(prompt: list[int], block_size: int, salt: str | None) -> list[int]:
    """Chain hashes of the prompt's whole blocks; the salt seeds the chain (cache_salt)."""
    out = []
    parent = hash(("salt", salt))
    for i in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt[i : i + block_size])))
        out.append(parent)
    return out


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    busy_s: float = 0.0


class Engine:
    """The scheduler and its clock; see the module docstring for the rules."""

    def __init__(
        self,
        profile: Profile,
        *,
        max_running: int | None = None,
        keep_finished: int = 2_000,
        on_emit: Callable[[Request], None] | None = None,
    ):
        self.profile = profile
        self.bs = profile.block_size
        self.pool = BlockPool(profile.usable_blocks)
        self.now = 0.0
        self.frontend: list[tuple[float, int, Request]] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_end: float | None = None
        self.step_plan: list[tuple[Request, int, bool]] = []
        self.max_running = max_running
        self.step_scale = 1.0  # faults.slow_steps_pct: a slower engine from now on
        self.on_emit = on_emit
        self.live: dict[str, Request] = {}
        self.finished: OrderedDict[str, Request] = OrderedDict()
        self.keep_finished = keep_finished
        self.counters = Counters()
        spec = profile.spec_decode
        self.k = spec.num_speculative_tokens if spec else 0
        if spec:
            self.counters.spec_accepted_per_pos = [0] * self.k
        self._seq = 0
        self._seq_h = 0
        self._start_at: float | None = None
        self._n_frontend = 0
        self.outputs: list[tuple[float, int, Request, int]] = []  # held first tokens
        self._out_gen = 0

    # --- the API the server and predictor use -----------------------------------------------
    def add(self, req: Request, now: float | None = None, received: float | None = None) -> Request:
        """A request handed over at `now` (default: the engine's clock), once the server has
        parsed and tokenized it. Its front end's delay counts from `received` (when the server
        got it; default `now`): the modelled front end (a real server's parsing, tokenizing and
        API work, as a page's first tokens hold them) runs while the simulator does its own, so a
        calibrated twin's first token is the page's while the simulator's own work fits in that
        delay. Where it does not, the arrival moves to `now` less the delay: the excess is the
        simulator's own work, never modelled time (the recorded TTFT stays the model's)."""
        self.advance(self.now if now is None else now)
        req.plen = len(req.prompt)
        delay = self.profile.frontend_delay(req.plen, 1)
        req.arrival = (
            self.now if received is None else min(self.now, max(received, self.now - delay))
        )
        req.index = self._seq
        self._seq += 1
        if req.target <= 0:
            req.target = req.max_tokens
        spec = self.profile.spec_decode
        if spec is not None:
            req.pkey = key = prompt_key(req.prompt)
            req.acc_len = spec.draw_length(req.plen, key)
            req.cell_ctx = spec.cell_context(req.plen)
            req.weyl = random.Random(key ^ spec.seed).random()
        self.finished.pop(req.rid, None)  # an id reused after the earlier one finished
        self.live[req.rid] = req
        self._n_frontend += 1
        req.state = FRONTEND
        self._push_frontend(max(self.now, req.arrival + delay), req)
        self.advance(self.now)  # zero delay: admitted now
        return req

    def abort(self, rid: str, now: float | None = None) -> None:
        """The client went away: free everything the request holds (as vLLM aborts)."""
        self.advance(self.now if now is None else now)
        req = self.live.get(rid)
        if req is None or req.state == FINISHED:
            return
        if req.state in (FRONTEND, FRONTEND2):
            self._n_frontend -= 1
        elif req.state == WAITING:
            self.waiting.remove(req)
        elif req.state == RUNNING:
            self.running.remove(req)
        self._finish(req, "abort")
        if self.step_end is None:
            self._start_step()

    def held(self) -> int:
        """Requests the server holds: in the front end, waiting or running."""
        return self._n_frontend + len(self.waiting) + len(self.running)

    def next_event_time(self) -> float | None:
        if self._start_at is not None:
            return self._start_at
        fe = self.frontend
        while fe and fe[0][2].state not in (FRONTEND, FRONTEND2):
            heapq.heappop(fe)
        t = self.step_end
        if fe and (t is None or fe[0][0] < t):
            t = fe[0][0]
        outs = self.outputs
        while outs and outs[0][2].held_first != outs[0][3]:
            heapq.heappop(outs)  # preempted or aborted while held
        if outs and (t is None or outs[0][0] < t):
            t = outs[0][0]
        return t

    def advance(self, until: float, max_events: int | None = None) -> bool:
        """Process events up to simulated time `until`, each at its exact time.

        With `max_events`, stop after that many (the server yields its event loop between
        batches when it has fallen behind); returns whether events due by `until` remain.
        """
        done = 0
        while True:
            if max_events is not None and done >= max_events:
                t = self.next_event_time()
                return t is not None and t <= until
            done += 1
            t = self.next_event_time()
            if t is None or t > until:
                break
            self.now = max(self.now, t)
            if self._start_at is not None:  # a step start deferred to its own event
                self._start_at = None
                if self.step_end is None:
                    self._start_step()
                continue
            ended = False
            if self.step_end is not None and self.step_end <= t:
                self._end_step()
                ended = True
            outs = self.outputs
            while outs and outs[0][0] <= self.now:
                _, _, req, gen = heapq.heappop(outs)
                if req.held_first == gen and req.state == RUNNING:
                    req.held_first = 0
                    self._emit(req, 1, self.now)
                    if req.state == FINISHED:
                        self.running = [r for r in self.running if r.state == RUNNING]
            fe = self.frontend
            while fe and fe[0][0] <= self.now:
                _, _, req = heapq.heappop(fe)
                if req.state == FRONTEND:
                    held = self.held()
                    p = self.profile
                    extra = p.frontend_delay(req.prompt_len, held) - p.frontend_delay(
                        req.prompt_len, 1
                    )
                    req.state = FRONTEND2
                    self._push_frontend(self.now + max(0.0, extra), req)
                elif req.state == FRONTEND2:
                    self._n_frontend -= 1
                    req.state = WAITING
                    req.ready = self.now
                    self.waiting.append(req)
            if self.step_end is None:
                if ended and max_events is not None:
                    # Batched callers (the server) get the next step's start as a separate
                    # event at the same simulated time: two short loop callbacks, not one.
                    self._start_at = self.now
                else:
                    self._start_step()
        if until > self.now:
            self.now = until
        return False

    def get(self, rid: str) -> Request | None:
        return self.live.get(rid) or self.finished.get(rid)

    def kv_usage(self) -> float:
        return self.pool.used / self.pool.num_blocks

    # --- internals ---------------------------------------------------------------------------
    def _push_frontend(self, t: float, req: Request) -> None:
        self._seq_h += 1
        heapq.heappush(self.frontend, (t, self._seq_h, req))

    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.held_first = 0
        victim.preemptions += 1
        victim.state = WAITING
        self.waiting.appendleft(victim)
        self.counters.preemptions += 1
        return victim

    def _start_step(self) -> None:
        p = self.profile
        bs = self.bs
        pool = self.pool
        budget = p.max_num_batched_tokens
        plan: list[tuple[Request, int, bool]] = []
        k1 = 1 + self.k
        dec_b = 0
        dec_t = 0
        dec_p = 0
        prefill_cost = 0.0
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            r = running[i]
            if r.held_first:
                i += 1
                continue
            remaining = r.plen + r.out - r.num_computed
            decode = r.out > 0 and remaining == 1
            n = k1 if decode else min(remaining, budget)
            need = -(-(r.num_computed + n) // bs) - len(r.blocks)
            preempted_self = False
            while need > len(pool.free_q):
                if self._preempt_last() is r:
                    preempted_self = True
                    break
            if preempted_self:
                break
            if need > 0:
                r.blocks.extend(pool.allocate(need))
            plan.append((r, n, decode))
            budget -= n
            if decode:
                dec_b += 1
                dec_t += r.num_computed + 1
                dec_p += r.plen
            else:
                prefill_cost += p.prefill_time(r.num_computed + n) - p.prefill_time(r.num_computed)
            i += 1
        cap = p.max_num_seqs if self.max_running is None else min(p.max_num_seqs, self.max_running)
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < cap:
            r = waiting[0]
            total = r.plen + r.out
            if r.hashes is None:
                r.hashes = block_hashes(r.prompt, bs, r.salt)
            hit = pool.lookup(r.hashes, (total - 1) // bs)
            hits = len(hit) * bs
            n = min(total - hits, budget)
            need = -(-(hits + n) // bs) - len(hit)
            reclaim = sum(1 for b in hit if pool.ref[b] == 0)
            if need > pool.free - reclaim:
                break
            pool.touch(hit)
            r.blocks = hit + (pool.allocate(need) if need > 0 else [])
            r.num_computed = hits
            if r.first_scheduled is None:
                r.first_scheduled = self.now
                r.cached_tokens = hits
                self.counters.prefix_queries += r.prompt_len
                self.counters.prefix_hits += min(hits, r.prompt_len)
            waiting.popleft()
            r.state = RUNNING
            running.append(r)
            plan.append((r, n, False))
            budget -= n
            prefill_cost += p.prefill_time(hits + n) - p.prefill_time(hits)
        if not plan:
            self.step_end = None
            self.step_plan = []
            return
        duration = p.decode_step_time(dec_b, dec_t, dec_p) + prefill_cost
        duration = max(duration, p.min_step_s) * self.step_scale
        self.step_plan = plan
        self.step_end = self.now + duration
        self.counters.steps += 1
        self.counters.busy_s += duration

    def _end_step(self) -> None:
        t = self.step_end
        assert t is not None
        self.now = max(self.now, t)
        plan, self.step_plan, self.step_end = self.step_plan, [], None
        bs = self.bs
        pool = self.pool
        c = self.counters
        spec = self.profile.spec_decode
        done = False
        held = self.held() if spec is not None else 0
        ranks: dict[Request, tuple[int, int]] | None = None
        for r, n, decode in plan:
            if r.state != RUNNING:
                continue  # aborted or preempted meanwhile
            if decode:
                e = 1
                if spec is not None:
                    cell = spec.cell(r.cell_ctx, held)
                    length = r.acc_len
                    if cell is not None:
                        if ranks is None:
                            ranks = _cell_ranks(plan)
                        length = spec.cell_length(cell[0], cell[1], *ranks[r], cell[2])
                    survival = spec.survival(length)
                    r.weyl = u = (r.weyl + GOLDEN) % 1.0
                    acc = 0
                    for pos, s in enumerate(survival):
                        if u >= s:
                            break
                        acc += 1
                        c.spec_accepted_per_pos[pos] += 1
                    c.spec_drafts += 1
                    c.spec_draft_tokens += self.k
                    c.spec_accepted += acc
                    r.accepted.append(acc)
                    e += acc
            else:
                before = r.num_computed
                r.num_computed += n
                if r.hashes and before < r.plen:
                    hashes = r.hashes
                    lo, hi = before // bs, min(r.num_computed, r.plen) // bs
                    for j in range(lo, min(hi, len(hashes))):
                        pool.register(r.blocks[j], hashes[j])
                e = 1 if r.num_computed == r.plen + r.out else 0
            if not e:
                continue
            if r.out == 0:
                hold = self.profile.first_token_output(r.plen, held or self.held())
                if hold > 0:  # the API server sends it later; the request waits for that
                    self._out_gen += 1
                    r.held_first = self._out_gen
                    heapq.heappush(self.outputs, (t + hold, self._out_gen, r, self._out_gen))
                    continue
            done = self._emit(r, e, t) or done
        if done:
            self.running = [r for r in self.running if r.state == RUNNING]

    def _emit(self, r: Request, e: int, t: float) -> bool:
        """`e` tokens of `r` out at `t` (cut at its target); True when that finished it."""
        c = self.counters
        e = min(e, r.target - r.out)
        if r.out == 0:
            c.prompt_tokens += r.plen
        r.out += e
        r.num_computed = r.plen + r.out - 1
        if e == 1:
            r.token_times.append(t)
        else:
            r.token_times.extend([t] * e)
        c.generation_tokens += e
        if r.out >= r.target:
            self._finish(r, r.finish_on_target)
            return True
        if self.on_emit is not None:
            self.on_emit(r)
        return False

    def _finish(self, req: Request, reason: str) -> None:
        req.state = FINISHED
        req.held_first = 0
        req.finish_reason = reason
        req.finished_at = self.now
        self.pool.release(req.blocks)
        req.blocks = []
        # Ground truth keeps timings, not the prompt: a 256K-token prompt is ~10 MB of ints.
        req.plen = req.plen or len(req.prompt)
        req.prompt = []
        req.hashes = None
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.live.pop(req.rid, None)
        self.finished[req.rid] = req
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
        if self.on_emit is not None:
            self.on_emit(req)
