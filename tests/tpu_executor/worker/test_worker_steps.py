"""The worker's launch/collect protocol: steps left on the device are collected oldest first,
and a failure at launch or at read-back fails only that step."""
from tpu_executor.core.config import (
    CacheConfig,
    CompileConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tpu_executor.core.step import DecodeWork, ModelRunnerOutput, SampledTokens, SamplingMeta, SchedulerOutput
from tpu_executor.worker.worker import Worker


class FakeLaunched:
    def __init__(self, step: SchedulerOutput, fails: bool):
        self.step, self.fails = step, fails

    def collect(self) -> ModelRunnerOutput:
        if self.fails:
            raise RuntimeError("device lost the buffer")
        ids = [w.request_id for w in self.step.decodes]
        return ModelRunnerOutput(SampledTokens(ids, [len(rid) for rid in ids], [0.0] * len(ids)))


class FakeRunner:
    """Queues steps like the XLA runner (tokens stay on the device until collected)."""

    collects_late = True

    def __init__(self):
        self.fail_launch, self.fail_collect = set(), set()

    def launch(self, step: SchedulerOutput) -> FakeLaunched:
        rid = step.decodes[0].request_id
        if rid in self.fail_launch:
            raise ValueError("bad input")
        return FakeLaunched(step, rid in self.fail_collect)


def step_of(request_id: str) -> SchedulerOutput:
    return SchedulerOutput(decodes=(DecodeWork(request_id, 5, 3, (1,), SamplingMeta.greedy()),))


def worker_with_fake_runner(tmp_path) -> Worker:
    config = EngineConfig(model=ModelConfig(model=str(tmp_path)), cache=CacheConfig(block_size=16),
                          scheduler=SchedulerConfig(), compile=CompileConfig(), device=DeviceConfig("cpu"),
                          max_model_len=64)
    worker = Worker(config)
    worker.runner = FakeRunner()
    return worker


def test_steps_left_on_the_device_are_collected_oldest_first(tmp_path):
    worker = worker_with_fake_runner(tmp_path)
    assert worker.launch_step(step_of("a")) is None and worker.launch_step(step_of("bb")) is None
    assert worker.collect_step().sampled.request_ids == ["a"]
    assert worker.launch_step(step_of("ccc")) is None
    assert worker.collect_step().sampled.token_ids == [2]
    assert worker.collect_step().sampled.request_ids == ["ccc"]


def test_a_failed_launch_or_read_back_fails_only_that_step(tmp_path):
    worker = worker_with_fake_runner(tmp_path)
    worker.runner.fail_launch, worker.runner.fail_collect = {"bad"}, {"lost"}
    assert worker.launch_step(step_of("a")) is None
    failed = worker.launch_step(step_of("bad"))  # answered at once; nothing queued
    assert failed.error == "ValueError: bad input"
    assert worker.launch_step(step_of("lost")) is None and worker.launch_step(step_of("z")) is None
    assert worker.collect_step().sampled.request_ids == ["a"]
    assert worker.collect_step().error == "RuntimeError: device lost the buffer"
    assert worker.collect_step().sampled.request_ids == ["z"]
    assert worker.execute_model(step_of("sync")).sampled.request_ids == ["sync"]
