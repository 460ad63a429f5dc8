"""A Claude-Code-like agent loop on the official `anthropic` SDK, streamed: every turn the
model's tool_use blocks are answered with tool_result blocks. Even turns force a tool call
(tool_choice any); when a turn ends without one, the loop fabricates the exchange it would
have run, so the history always carries tool_use/tool_result pairs. With `--no-forced-tools`
no turn forces a call: llama-server cannot build the grammar that forcing needs for a model
whose vocabulary has no tool-call tokens, and answers 400.

Usage: anthropic_loop.py BASE_URL SESSIONS TURNS [--no-forced-tools]. Prints one JSON line per turn with the
session, turn, the replica that answered (x-inference-pod) and the client-measured TTFT.
"""
import json
import sys
import time

import anthropic

base_url, sessions, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
forced_tools = "--no-forced-tools" not in sys.argv[4:]
client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
tools = [{
    "name": "read_file",
    "description": "Read a file of the repository",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}]
for s in range(sessions):
    system = f"You are coding agent {s}. Work in the repository and use the tools."
    messages = [{"role": "user", "content": f"Session {s}: the test in src/lib.rs fails, fix it."}]
    for t in range(turns):
        choice = {"type": "any"} if forced_tools and t % 2 == 0 else {"type": "auto"}
        sent = time.monotonic()
        ttft = None
        with client.messages.stream(model="sim", max_tokens=48, system=system, messages=messages,
                                    tools=tools, tool_choice=choice) as stream:
            pod = stream.response.headers.get("x-inference-pod")
            for event in stream:
                if ttft is None and event.type == "content_block_delta":
                    ttft = time.monotonic() - sent
            final = stream.get_final_message()
        content = [b.model_dump(exclude_none=True) for b in final.content]
        uses = [b for b in content if b["type"] == "tool_use"]
        if not uses:
            uses = [{"type": "tool_use", "id": f"toolu_local{s}x{t}", "name": "read_file",
                     "input": {"path": "src/lib.rs"}}]
            content.append(uses[0])
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u["id"], "content": f"contents of {u['input'].get('path', '?')}"}
            for u in uses]})
        print(json.dumps({"api": "messages", "session": s, "turn": t, "pod": pod,
                          "tool_use": final.stop_reason == "tool_use", "ttft_s": ttft,
                          "cache_read": final.usage.cache_read_input_tokens}), flush=True)
