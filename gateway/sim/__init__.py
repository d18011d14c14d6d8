"""Engine simulator: vLLM-, SGLang- and llama.cpp-flavoured OpenAI servers with a latency model.

Entry points: `runner.start_sim(SimOptions(...))` in-process, `main.add_arguments` / `main.run` for
`shapegate sim`, and `python -m gateway.sim`. The latency model is `scheduler.Scheduler` (pure, one
step at a time) with numbers from `profiles/*.toml`; `engine.EngineLoop` runs it in real time and
`virtual.run_closed_loop` runs it on a virtual clock.
"""
