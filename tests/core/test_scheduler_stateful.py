"""Random add / step (fork after the prompt, append, copy-on-write, preempt,
swap, stop) / finish / abort sequences against the scheduler, checking the KV
accounting and the simulated cache contents after every step."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.sequence import SequenceStatus

from .helpers import KVMemory, check_kv_invariants, make_group, make_scheduler, sample

BS = 8
MAX_OUTPUT = 6
PREFIXES = [[k * 100 + i for i in range(40)] for k in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), chunked=st.booleans(),
                num_blocks=st.integers(4, 14), budget=st.integers(8, 40))
    def setup(self, mode, caching, chunked, num_blocks, budget):
        self.sched = make_scheduler(
            block_size=BS, num_device_blocks=num_blocks, num_cpu_blocks=num_blocks // 2, max_num_seqs=5,
            max_num_batched_tokens=budget, max_model_len=40, enable_prefix_caching=caching,
            enable_chunked_prefill=chunked, preemption_mode=mode)
        self.memory = KVMemory()
        self.groups = {}

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 30), n=st.integers(1, 3),
          salt=st.sampled_from([None, b"tenant"]), priority=st.sampled_from([0, 0, 1, -1]))
    def add(self, prefix, length, n, salt, priority):
        group = make_group(f"r{len(self.groups)}", PREFIXES[prefix][:length], arrival=len(self.groups), n=n,
                           salt=salt, max_tokens=MAX_OUTPUT, priority=priority)
        self.groups[group.request_id] = group
        self.sched.add_group(group)

    @rule(num_steps=st.integers(1, 4))
    def steps(self, num_steps):
        for _ in range(num_steps):
            self.step()

    def step(self):
        sched, kv = self.sched, self.sched.kv
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        for s in out.scheduled:  # never write a shared block in place
            for j in range(s.start // BS, -(-(s.start + s.num_new_tokens) // BS)):
                assert kv.device_pool.blocks[s.block_table[j]].ref_count == 1
        assert not {d for d, _ in out.blocks_to_swap_out} & {d for _, d in out.blocks_to_swap_in}
        assert all(kv.device_pool.blocks[d].ref_count == 1 for _, d in out.blocks_to_copy)
        self.memory.execute(out, BS)
        sched.update_from_output(out, sample(out, _token))  # stops at MAX_OUTPUT or max_model_len
        self._check_contents()

    @precondition(lambda self: len(self.sched.running))
    @rule(data=st.data())
    def finish(self, data):
        running = [(g, s) for g in self.sched.running.values() for s in g.seqs if not s.is_finished]
        group, seq = data.draw(st.sampled_from(running))
        self.sched.finish_seq(group, seq, SequenceStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.groups)))
        for group in self.sched.abort([request_id]):
            assert all(s.is_finished for s in group.seqs)

    def _check_contents(self):
        for group in list(self.sched.running.values()) + list(self.sched.swapped):
            for seq in group.unfinished_seqs():
                table = self.sched.kv.tables[seq.seq_id]
                got = self.memory.tokens_of(table.block_ids, seq.num_computed_tokens, BS, table.on_cpu)
                assert got == seq.token_ids[:seq.num_computed_tokens]

    @invariant()
    def accounting(self):
        if not hasattr(self, "sched"):
            return
        check_kv_invariants(self.sched.kv)
        expected_tables = set()
        for group in self.groups.values():
            for seq in group.unfinished_seqs():
                if seq.status is not SequenceStatus.WAITING:
                    expected_tables.add(seq.seq_id)
        assert set(self.sched.kv.tables) == expected_tables, "a finished or waiting sequence holds blocks"
        kv = self.sched.kv
        everything = []
        for group in self.sched.running.values():  # the counting-free test never lies, per group or for all
            requests = [(s.seq_id, s.num_tokens - s.num_computed_tokens) for s in group.seqs_with(SequenceStatus.RUNNING)]
            if kv.fits_without_counting(sum(n for _, n in requests), len(requests)):
                assert kv.num_new_blocks(requests) <= kv.num_free_blocks
            everything += requests
        if kv.fits_without_counting(sum(n for _, n in everything), len(everything)):
            assert kv.num_new_blocks(everything) <= kv.num_free_blocks
        for queue in (list(self.sched.running.values()), self.sched.waiting, self.sched.swapped):
            ranks = [(g.priority, g.metrics.arrival_time) for g in queue]
            assert ranks == sorted(ranks), "a queue out of priority-then-arrival order"
        num_running_seqs = sum(len(g.seqs_with(SequenceStatus.RUNNING)) for g in self.sched.running.values())
        assert num_running_seqs <= self.sched.config.max_num_seqs
        if not self.sched.has_unfinished():
            stats = self.sched.stats()
            assert stats.num_blocks_used == 0 and stats.num_cpu_blocks_used == 0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(100 + 50 * len(self.groups)):  # nothing may wedge: everything finishes or fails
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.sched.stats().num_blocks_used == 0


def _token(group, seq):
    # Independent of the global seq ids, so every example replays identically; siblings diverge.
    return (seq.index * 7 + seq.num_tokens + int(group.request_id[1:])) % 50


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase
