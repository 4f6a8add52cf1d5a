"""One device: worker, model runner, input building, sampler, compile guard, distributed
set-up and model loader. Never imports the engine or the entry points."""
