"""The contract between the supervisor and an engine worker, torch-free by construction: requests
(GenerationRequest, EmbedRequest, SamplingParams, the structured output spec), the wire messages,
what comes back (RequestOutput, EngineSnapshot), tenant policies, EngineConfig and the Device protocol."""
