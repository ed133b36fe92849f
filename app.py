"""crowdchat: many people chatting with one shared, quantized model. Composition root."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

from engine import CrowdchatError, Engine, EngineConfig, SamplingParams
from engine.chat_format import ChatFormatter
from engine.errors import ModelLoadError

log = logging.getLogger("crowdchat")
MAX_MESSAGE_CHARS = 32_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="crowdchat: one model, a whole crowd of users")
    EngineConfig.add_arguments(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--cli", action="store_true", help="chat in the terminal instead of a page")
    return ap.parse_args(argv)


def to_text(content: object) -> str:
    """Gradio history content as plain text (files and components are not chat text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def reply_stream(engine: Engine, formatter: ChatFormatter, messages: list[dict[str, str]],
                 params: SamplingParams) -> Iterator[str]:
    """Yield the reply as it grows; cancel generation if the consumer goes away."""
    handle = engine.submit(formatter.encode(messages), params)
    text = ""
    try:
        for delta in handle:
            text += delta
            yield text
    finally:
        handle.cancel()  # no-op when finished; frees the blocks when the user pressed Stop


def run_cli(engine: Engine, formatter: ChatFormatter) -> None:
    history: list[dict[str, str]] = []
    print("crowdchat CLI: type a message, empty line to quit.")
    for line in sys.stdin:
        if not line.strip():
            break
        history.append({"role": "user", "content": line.rstrip("\n")})
        text = ""
        for text in reply_stream(engine, formatter, history, SamplingParams(temperature=0.7)):
            pass
        print(text, flush=True)
        history.append({"role": "assistant", "content": text})


def build_page(engine: Engine, formatter: ChatFormatter):  # noqa: ANN201 - gradio Blocks
    import gradio as gr

    def respond(message: str, history: list[dict]) -> Iterator[str]:
        if not message or not message.strip():
            raise gr.Error("Please type a message first.")
        if len(message) > MAX_MESSAGE_CHARS:
            raise gr.Error(f"That message is too long ({len(message)} characters; "
                           f"the limit is {MAX_MESSAGE_CHARS}).")
        msgs = [{"role": m["role"], "content": to_text(m["content"])} for m in history
                if m.get("role") in ("user", "assistant")]
        msgs.append({"role": "user", "content": message})
        try:
            yield from reply_stream(engine, formatter, msgs, SamplingParams(temperature=0.7,
                                                                            top_p=0.9))
        except CrowdchatError as e:
            raise gr.Error(str(e)) from e

    demo = gr.ChatInterface(respond, title="crowdchat", concurrency_limit=None)
    demo.queue(default_concurrency_limit=engine.config.max_num_seqs,
               max_size=engine.config.max_queue)
    return demo


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:
        engine = Engine(EngineConfig.from_namespace(args))
    except (ModelLoadError, CrowdchatError) as e:
        sys.exit(f"crowdchat: {e}")
    s = engine.stats()
    log.info("model %.1f MB; KV pool %.1f MB = %d blocks x %d tokens (%d tokens, %d bytes/token)",
             s.model_bytes / 2**20, s.kv_bytes / 2**20, s.blocks_total, s.block_size,
             s.blocks_total * s.block_size, s.kv_bytes_per_token)
    formatter = ChatFormatter(engine.tokenizer)
    try:
        if args.cli:
            run_cli(engine, formatter)
        else:
            build_page(engine, formatter).launch(server_name=args.host, server_port=args.port)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
