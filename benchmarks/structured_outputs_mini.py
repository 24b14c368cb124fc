"""N json_schema chat requests (temperature 1, seeds 0..N-1, 32 at a time) through the openai client
against the mini model: how many finish with "stop" and validate against the schema.

    PYTHONPATH=. python benchmarks/structured_outputs_mini.py 100
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai

sys.path.insert(0, "tests/support")
from live_server import LiveServer  # noqa: E402

from mstar.config import load_serve_config  # noqa: E402
from mstar.serve import build_engine  # noqa: E402
from mstar.server import build_app  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Tokyo", "Lima"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    engine = build_engine(load_serve_config("configs/kimi_k3_mini.yaml", []))
    live = LiveServer(build_app(engine, served_model_name="mini"))
    live.start()
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def one(i: int) -> tuple[bool, str]:
        r = client.chat.completions.create(
            model="mini", messages=[{"role": "user", "content": f"Describe person {i} as JSON."}], max_tokens=80,
            temperature=1.0, seed=i, response_format=FORMAT, extra_body={"chat_template_kwargs": {"thinking": False}})
        choice = r.choices[0]
        try:
            ok = choice.finish_reason == "stop" and jsonschema_rs.is_valid(SCHEMA, json.loads(choice.message.content))
        except json.JSONDecodeError:
            ok = False
        return ok, choice.message.content

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(n)))
    print(f"{sum(ok for ok, _ in results)} of {n} valid in {time.perf_counter() - start:.1f} s")
    print("invalid:", [text for ok, text in results if not ok][:3])
    print("first:", results[0][1])
    live.stop()
    engine.shutdown()


if __name__ == "__main__":
    main()
