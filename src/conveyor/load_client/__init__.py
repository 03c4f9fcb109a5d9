"""`conveyor bench serve`'s load client: streams a workload to a running OpenAI-compatible
server and reports its latencies, like vLLM's. The benchmark scripts are benchmarks/ at the
repository's root; they import this client and `sibling.load_sibling`."""
