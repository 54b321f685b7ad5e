"""A link endpoint whose bandwidth is shared fairly by the transfers in flight on it.

Processor sharing: with k transfers active each progresses at bandwidth / k. Whenever a transfer
starts or ends, progress is brought up to date and the next completion is re-timed; a stale
timer (superseded by a later change) is ignored by comparing versions. The same re-timing applies
a slowdown of the sender (``set_slowdown``: its cores shared with compute, ``sim.host_cpu``).
"""

from __future__ import annotations

import simpy


class SharedChannel:
    def __init__(self, env: simpy.Environment, bandwidth_Bps: float) -> None:
        if bandwidth_Bps <= 0:
            raise ValueError("bandwidth must be positive")
        self.env = env
        self.bandwidth = bandwidth_Bps
        self._active: dict[int, list] = {}  # id -> [remaining bytes, completion event]
        self._next_id = 0
        self._version = 0
        self._last = 0.0
        self.busy_until = 0.0
        self.slowdown = 1.0  # every transfer takes this many times as long (the sender's CPU shared)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def transfer(self, nbytes: float) -> simpy.Event:
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._active[self._next_id] = [float(nbytes), done]
        self._next_id += 1
        self._retime()
        return done

    def set_slowdown(self, slowdown: float) -> None:
        """From now on the transfers progress 1 / ``slowdown`` as fast (what is left re-timed)."""
        if slowdown == self.slowdown:
            return
        self._advance()
        self.slowdown = slowdown
        self._retime()

    def _advance(self) -> None:
        now = self.env.now
        if self._active and now > self._last:
            progressed = (now - self._last) * self.bandwidth / (len(self._active) * self.slowdown)
            for entry in self._active.values():
                entry[0] -= progressed
        self._last = now

    def _retime(self) -> None:
        self._version += 1
        if not self._active:
            return
        version = self._version
        due, shortest = min(((key, entry[0]) for key, entry in self._active.items()), key=lambda kv: kv[1])
        delay = max(shortest, 0.0) * len(self._active) * self.slowdown / self.bandwidth
        self.busy_until = self.env.now + delay
        self.env.timeout(delay).callbacks.append(lambda _event: self._on_timer(version, due))

    def _on_timer(self, version: int, due: int) -> None:
        if version != self._version:
            return
        self._advance()
        # The transfer this timer was set for is done, whatever rounding left of it (a delay
        # below the clock's resolution would otherwise never make progress); so is any other
        # within a byte of done.
        finished = [key for key, entry in self._active.items() if key == due or entry[0] <= 1.0]
        for key in finished:
            self._active.pop(key)[1].succeed()
        self._retime()
