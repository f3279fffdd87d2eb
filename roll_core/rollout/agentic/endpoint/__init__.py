"""The endpoint roll serves during agentic rollout (bring your own agent): each episode's
calls, through OpenAI Chat Completions, the Responses API or Anthropic Messages, stitched into
one trajectory token-in/token-out.

* :mod:`.session`: one episode's conversation, the trajectory rules, what a call may ask;
* :mod:`.calls`: the call and reply every API is translated to and from;
* :mod:`.fields`: how request fields are read (each honoured or refused);
* :mod:`.openai_chat`, :mod:`.responses`, :mod:`.anthropic`: the three APIs;
* :mod:`.server`: routes, bounded reads, errors, the sessions' base URLs.
"""

from roll_core.rollout.agentic.endpoint.calls import ChatCall, ClientGone, EndpointError, Reply
from roll_core.rollout.agentic.endpoint.openai_chat import ChatCompletions, parse_chat
from roll_core.rollout.agentic.endpoint.server import AgentEndpoint, check_port, port_in_use
from roll_core.rollout.agentic.endpoint.session import AgentSession, prompt_key

__all__ = [
    "AgentEndpoint",
    "AgentSession",
    "ChatCall",
    "ChatCompletions",
    "ClientGone",
    "EndpointError",
    "Reply",
    "chat_completion",
    "check_port",
    "parse_chat",
    "port_in_use",
    "prompt_key",
]


def chat_completion(session: AgentSession, body: dict) -> dict:
    """Serve one Chat Completions request body on ``session`` without HTTP (tests, scripted
    play): the ``chat.completion`` object."""
    from roll_core.rollout.agentic.endpoint.openai_chat import chat_body

    call, _, _ = parse_chat(body)
    return chat_body(session.serve(call), str(body.get("model", session.model)))
