"""The engine: LLMEngine (schedule -> execute -> update), its config, outputs and tokenizer.

Nothing is imported here: `conveyor.engine.config` and `conveyor.engine.outputs` are plain
Python that `core/` and the HTTP side read without pulling in torch through `llm_engine`.
"""
