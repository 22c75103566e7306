"""Record how vLLM's request validation reads a JSON value given for a bool field (``stream``,
``stream_options.include_usage``, ``use_beam_search``, ``background``), for the gateway's Go tests.

Input: none. Output: JSON on stdout, ``[{"json": <the value as sent>, "bool": true | false | null}]``,
null where the engine answers 422 (or reads null). Run it with vLLM 0.32.0's own pins of pydantic,
pydantic-core, FastAPI and Starlette (tests/testbed/engine/requirements.txt), e.g.
``pip install pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.136.3 starlette==1.10.0 httpx``, then
``python tests/tools/pydantic_bool_oracle.py > roles/caddy/files/gateway/testdata/pydantic_bool.json``.
The model mirrors vLLM's: ``OpenAIBaseModel`` (extra allowed) with ``stream: bool | None = False``,
validated by FastAPI from the request body as vLLM's routes are.
"""

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

# Spellings a client could send: JSON literals, numbers near 0 and 1, strings pydantic lists or
# nearly lists, escapes, Unicode look-alikes that a Unicode case fold would accept.
VALUES = [
    "true", "false", "null", "0", "1", "-0", "2", "-1", "1.0", "0.0", "1e0", "10e-1", "1.00",
    "1.0000000000000001", "0.9999999999999999", "1.5", "1E0", "0e9", "100e-2", "1e400", "[]", "{}",
    "[true]", '"true"', '"True"', '"TRUE"', '"tRuE"', '"false"', '"FALSE"', '"1"', '"0"', '"yes"',
    '"YES"', '"no"', '"y"', '"n"', '"Y"', '"t"', '"f"', '"on"', '"off"', '"On"', '"OFF"', '" true"',
    '"true "', '"1.0"', '"01"', '""', '"tru"', '"truee"', '"\\u0074rue"', '"\\u0031"', '"ye\\u017f"',
    '"\\u017fes"', '"\\u2160"', '"\\uff11"', '"nope"', '"null"', '"none"', '"2"', '"-1"', '"+1"',
]


class Request(BaseModel):
    """The shape of vLLM 0.32's request models for this field."""

    model_config = ConfigDict(extra="allow")
    stream: bool | None = False


app = FastAPI()


@app.post("/v1/chat/completions")
async def chat(request: Request) -> dict:
    """Answer the bool as validated."""
    return {"stream": request.stream}


def main() -> None:
    """Print the oracle."""
    client = TestClient(app, raise_server_exceptions=False)  # 1e400: the 422 itself cannot be serialised
    rows = []
    for value in VALUES:
        answer = client.post("/v1/chat/completions", content=f'{{"stream": {value}}}',
                             headers={"Content-Type": "application/json"})
        rows.append({"json": value, "bool": answer.json()["stream"] if answer.status_code == 200 else None})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
