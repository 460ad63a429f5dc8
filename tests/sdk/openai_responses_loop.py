"""A Codex-like agent loop on the official `openai` SDK's Responses API: each turn continues
the previous one by `previous_response_id`, answering the model's function calls with
`function_call_output` items. Even turns stream and force a call (tool_choice required), odd
turns are unstreamed.

Two options fit servers that offer less. `--stateless` sends the whole input every turn (the
previous output items, then the call outputs) and no `previous_response_id`: llama-server
keeps no responses and refuses that field with 400. A turn without a function call then gets
a fabricated one, so the history always carries function_call/function_call_output pairs.
`--no-forced-tools` never forces a call: llama-server cannot build the grammar forcing needs
for a model whose vocabulary has no tool-call tokens.

Usage: openai_responses_loop.py BASE_URL SESSIONS TURNS [--stateless] [--no-forced-tools].
Prints one JSON line per turn with the
session, turn, the replica that answered (x-inference-pod) and the client-measured TTFT; a turn
whose previous response the answering replica does not hold prints `failed` with the status,
and its session starts a new chain.
"""
import json
import sys
import time

import openai

base_url, sessions, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stateless = "--stateless" in sys.argv[4:]
forced_tools = "--no-forced-tools" not in sys.argv[4:]
client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
tools = [{
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}]


def turn(t, args, sent):
    """One request, streamed on even turns: the final response, the replica and the TTFT."""
    ttft = None
    if t % 2 == 0:
        choice = "required" if forced_tools else "auto"
        stream = client.responses.create(stream=True, tool_choice=choice, **args)
        pod = stream.response.headers.get("x-inference-pod")
        final = None
        for event in stream:
            if ttft is None and event.type.endswith(".delta"):
                ttft = time.monotonic() - sent
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    else:
        raw = client.responses.with_raw_response.create(**args)
        pod = raw.headers.get("x-inference-pod")
        final = raw.parse()
    return final, pod, ttft


for s in range(sessions):
    instructions = f"You are coding agent {s}. Work in the repository and use the tools."
    items = [{"role": "user", "content": f"Session {s}: the build is broken, find out why."}]
    previous = None
    for t in range(turns):
        args = dict(model="sim", instructions=instructions, input=items, tools=tools,
                    max_output_tokens=48)
        if previous and not stateless:
            args["previous_response_id"] = previous
        try:
            final, pod, ttft = turn(t, args, time.monotonic())
        except openai.NotFoundError as e:
            print(json.dumps({"api": "responses", "session": s, "turn": t, "failed": e.status_code}),
                  flush=True)
            previous = None
            items = [{"role": "user", "content": f"Session {s}: start over."}]
            continue
        previous = final.id
        calls = [o for o in final.output if o.type == "function_call"]
        if stateless:
            items += [o.model_dump(exclude_none=True) for o in final.output]
            if not calls:
                items.append({"type": "function_call", "call_id": f"call_local{s}x{t}",
                              "name": "read_file", "arguments": '{"path": "Cargo.toml"}'})
            ids = [c.call_id for c in calls] or [f"call_local{s}x{t}"]
            items += [{"type": "function_call_output", "call_id": i, "output": "ok"} for i in ids]
        elif calls:
            items = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
        else:
            items = [{"role": "user", "content": f"Turn {t}: go on."}]
        print(json.dumps({"api": "responses", "session": s, "turn": t, "pod": pod,
                          "function_calls": len(calls), "ttft_s": ttft,
                          "cached": final.usage.input_tokens_details.cached_tokens}), flush=True)
