"""The engine process: model + KV tiers + memory API, driven by the API process over ZMQ.

Started by the API process as ``python -m agentserving.engine.engine_process --index K
--in ADDR --out ADDR`` with the worker's settings (JSON) on stdin. Threads:

- main: the step loop — drain requests from ZMQ, ``EngineCore.step()``, send outputs, run
  deferred stores; idle-waits on the socket when there is no work;
- ``memory-api``: uvicorn serving ``engine_memory_app`` (memory API + KV hand-off) on
  ``memory_port_start + 1 + K``;
- ``residency``: every ``residency_interval_s``, diffs what LMCache's tiers hold against what
  it last reported and sends the change (so LMCache's own LRU evictions are reported too),
  expires unclaimed hand-offs, and sends stats.

The process exits when told to, when its parent dies, or on a fatal error (reported first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the API process dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--in", dest="in_addr", required=True)
    parser.add_argument("--out", dest="out_addr", required=True)
    args = parser.parse_args(argv)
    settings_json = sys.stdin.read()
    parent = os.getppid()
    _die_with_parent()
    code = 0
    try:
        code = run(settings_json, args.index, args.in_addr, args.out_addr, parent)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # LMCache leaves non-daemon threads behind


def run(settings_json: str, index: int, in_addr: str, out_addr: str, parent_pid: int) -> int:
    from agentserving.engine.allocator import bound_malloc_growth

    malloc = bound_malloc_growth()  # before any thread: see engine/allocator.py
    from agentserving.engine.settings import WorkerSettings

    settings = WorkerSettings.model_validate_json(settings_json)
    # LMCache reads its log level once, at import: set it from our settings first.
    os.environ["LMCACHE_LOG_LEVEL"] = settings.lmcache_log_level.upper()

    import zmq

    from agentserving.core.logging import configure_logging, get_logger
    from agentserving.engine import ipc

    configure_logging(settings.log_level, settings.log_json)
    log = get_logger("agentserving.engine.process").bind(engine=index)
    log.info("engine_malloc", **malloc)
    zctx = zmq.Context()
    out = zctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(out_addr)
    try:
        return _serve(settings, index, in_addr, out_addr, parent_pid, zctx, out, log)
    except BaseException as exc:
        log.error("engine_fatal", error=repr(exc), tb=traceback.format_exc())
        with contextlib.suppress(Exception):
            out.send(ipc.encode(ipc.Fatal(engine=index, error=repr(exc))))
        return 1
    finally:
        out.close()
        zctx.term()


def _serve(settings, index, in_addr, out_addr, parent_pid, zctx, out, log) -> int:  # noqa: ANN001
    import uvicorn
    import zmq

    from agentserving.decode.handoff.source import handoff_router
    from agentserving.engine import ipc
    from agentserving.engine.builder import build_engine
    from agentserving.engine.memory_api import engine_memory_app

    parts = build_engine(settings, index)
    core, store = parts.core, parts.store
    inbox = zctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    port = settings.engine_memory_port(index)
    app = engine_memory_app(store, [handoff_router(parts.handoff)], settings.internal_token)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=port,
                                           log_level="warning", access_log=False))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    http = threading.Thread(target=server.run, name="memory-api", daemon=True)
    http.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not http.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"memory API did not start on port {port}")
        time.sleep(0.02)

    stop = threading.Event()
    reporter = threading.Thread(target=_residency_loop, name="residency", daemon=True,
                                args=(parts, index, settings, zctx, out_addr, stop))
    reporter.start()
    out.send(ipc.encode(ipc.Ready(
        engine=index, memory_port=port, weights_digest=parts.bundle.weights_digest(),
        max_model_len=core.max_model_len, chunk_bytes=store.chunk_bytes,
        capacity_bytes={t.value: n for t, n in store.capacity_bytes().items()},
        backends=store.backends)))
    log.info("engine_ready", memory_port=port, model=parts.bundle.name)

    step_log = _open_step_log(settings, index, core)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_parent_check = time.monotonic()
    try:
        while not stop.is_set():
            # ms: spin while a step has work, poll gently while only a pull is on the wire
            timeout = 0 if core.has_ready_work() else 1 if core.has_work() else 50
            while poller.poll(timeout):
                msg = ipc.decode_to_engine(inbox.recv())
                timeout = 0
                if isinstance(msg, ipc.AddRequest):
                    _add(core, msg, out, index)
                elif isinstance(msg, ipc.Abort):
                    core.abort(msg.req_id)
                elif isinstance(msg, ipc.Shutdown):
                    stop.set()
                    break
            if stop.is_set():
                break
            if core.has_work():
                _step(core, out, index, log)
                if step_log is not None:
                    _write_steps(core, step_log, settings.role.value)
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != parent_pid:
                    log.warning("parent_gone_exiting")
                    break
    finally:
        stop.set()
        if step_log is not None:
            step_log.close()
        server.should_exit = True
        http.join(5)
        inbox.close()
        parts.close()
    return 0


def _open_step_log(settings, index, core):  # noqa: ANN001, ANN202
    """``--step-log-dir``: keep a record of every step, written after it."""
    if settings.step_log_dir is None:
        return None
    settings.step_log_dir.mkdir(parents=True, exist_ok=True)
    core.record_steps = True
    return open(settings.step_log_dir / f"{settings.pod_name}-{index}.jsonl", "a",  # noqa: SIM115
                buffering=1)


def _write_steps(core, f, role: str) -> None:  # noqa: ANN001
    for rec in core.step_records:
        f.write(json.dumps({"t": time.time(), "role": role, **dataclasses.asdict(rec)}) + "\n")
    core.step_records.clear()


def _add(core, msg, out, index) -> None:  # noqa: ANN001
    from agentserving.engine import ipc
    from agentserving.engine.scheduler.request import EngineRequest, SamplingParams

    req = EngineRequest(
        req_id=msg.req_id, prompt_token_ids=list(msg.prompt_token_ids),
        sampling=SamplingParams(
            max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
            seed=msg.seed, ignore_eos=msg.ignore_eos, stop_token_ids=tuple(msg.stop_token_ids),
            logprobs=msg.logprobs,
            forced_output_token_ids=(tuple(msg.forced_output_token_ids)
                                     if msg.forced_output_token_ids is not None else None)),
        cache_salt=msg.cache_salt, kv_transfer_params=msg.kv_transfer_params,
        arrival_time=msg.arrival_time or time.time())
    try:
        core.add(req)
    except ValueError as exc:
        out.send(ipc.encode(ipc.Outputs(engine=index, items=[ipc.OutputItem(
            req_id=msg.req_id, tokens=[], finished=True, finish_reason="error",
            error=str(exc))])))


def _step(core, out, index, log) -> None:  # noqa: ANN001
    from agentserving.engine import ipc

    try:
        outputs = core.step()
    except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
        log.error("engine_step_failed", error=repr(exc), tb=traceback.format_exc())
        items = []
        for req in list(core.running) + list(core.waiting):
            core.abort(req.req_id)
            items.append(ipc.OutputItem(req_id=req.req_id, tokens=[], finished=True,
                                        finish_reason="error", error=repr(exc)))
        out.send(ipc.encode(ipc.Outputs(engine=index, items=items)))
        return
    if outputs:
        items = [ipc.OutputItem(
            req_id=o.req_id,
            tokens=[ipc.TokenItem(t.token_id, t.logprob, t.top_logprobs) for t in o.tokens],
            finished=o.finished, finish_reason=o.finish_reason, meta=o.meta,
            kv_transfer_params=o.kv_transfer_params, error=o.error) for o in outputs]
        out.send(ipc.encode(ipc.Outputs(engine=index, items=items)))
    core.run_deferred()


def _residency_loop(parts, index, settings, zctx, out_addr, stop) -> None:  # noqa: ANN001
    import zmq

    from agentserving.core.logging import get_logger
    from agentserving.engine import ipc

    log = get_logger("agentserving.engine.residency").bind(engine=index)
    sock = zctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(out_addr)
    store, core, handoff = parts.store, parts.core, parts.handoff
    wire = store.keys.wire_of_int
    last: dict = {}
    try:
        while not stop.wait(settings.residency_interval_s):
            try:
                now = store.residency()
                resident = set().union(*now.values()) if now else set()
                store.forget_digests(resident)
                store.trim_lmcache_bookkeeping(resident)
                stored = {t.value: [wire(v) for v in vals - last.get(t, set())]
                          for t, vals in now.items()}
                removed = {t.value: [wire(v) for v in last.get(t, set()) - vals]
                           for t, vals in now.items()}
                if any(stored.values()) or any(removed.values()):
                    sock.send(ipc.encode(ipc.Residency(
                        engine=index, stored={k: v for k, v in stored.items() if v},
                        removed={k: v for k, v in removed.items() if v},
                        bytes={t.value: len(v) * store.chunk_bytes for t, v in now.items()})))
                last = now
                handoff.expire()
                hs, ks, cs = handoff.stats, store.stats, core.stats
                sock.send(ipc.encode(ipc.Stats(
                    engine=index, waiting=core.num_waiting, running=core.num_running,
                    counters={
                        "transfer_bytes_sent": hs.bytes_sent,
                        "transfer_bytes_received": cs.transfer_bytes_received,
                        "transfer_failures": cs.transfer_failures,
                        "transfer_tokens_skipped": hs.tokens_skipped,
                        "transfer_tokens_local": cs.transfer_tokens_local,
                        "handoffs_registered": hs.registered, "handoffs_claimed": hs.claimed,
                        "handoffs_expired": hs.expired, "handoffs_pending": handoff.pending(),
                        "kv_corrupt_chunks": ks.corrupt_chunks,
                        "kv_missing_chunks": ks.missing_chunks,
                        "kv_disk_write_errors": ks.disk_write_errors,
                        "kv_prefetched_chunks": ks.prefetched_chunks,
                        "kv_evicted_chunks": ks.evicted_chunks,
                        "kv_stored_chunks": ks.stored_chunks,
                    })))
            except Exception as exc:  # noqa: BLE001 - keep reporting
                log.warning("residency_scan_failed", error=repr(exc))
    finally:
        sock.close()


if __name__ == "__main__":
    main()
