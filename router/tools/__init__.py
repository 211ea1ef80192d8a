"""Tool calling on /v1/chat/completions: the request's `tools`/`tool_choice`
(`request`), the parsers that find tool calls in generated text (`base`,
`json_call`, `llama3_json`, `hermes`, chosen by `select`), and the stream
adapter that turns a flow's deltas into OpenAI `tool_calls` deltas
(`extractor`). See docs/router.md, "Tool calls"."""
