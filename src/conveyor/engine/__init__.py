"""The engine: LLMEngine (schedule -> execute -> update), its outputs and tokenizer.

Nothing is imported here: `conveyor.engine.outputs` is plain Python that the HTTP side reads
without pulling in torch through `llm_engine`.
"""
