"""`proto.status`: exception -> gRPC status mapping tables, through a real aio server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.message import DecodeError

from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.status import ServiceError, StatusMap, grpc_errors


class _PoolFull(Exception):
    pass


class _NoBlocks(_PoolFull):
    pass


# What a service that meets capacity errors passes its methods explicitly.
_CAPACITY = StatusMap(((_PoolFull, grpc.StatusCode.RESOURCE_EXHAUSTED),))


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (ValueError("prompt has 9 tokens, max_model_len is 8"), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt has 9 tokens, max_model_len is 8"),
        (_NoBlocks("no free blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks"),
        (_PoolFull("landing pool full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "landing pool full"),
        (ServiceError(grpc.StatusCode.ABORTED, "kv transfer failed: deadline"),
         grpc.StatusCode.ABORTED, "kv transfer failed: deadline"),
        (KeyError("x"), grpc.StatusCode.INTERNAL, "internal error: KeyError: 'x'"),
        # a client-streamed message that does not parse is raised inside the servicer
        (DecodeError("Wire format was corrupt"), grpc.StatusCode.INVALID_ARGUMENT,
         "a request message does not parse: Wire format was corrupt"),
    ],
)
def test_status_for_maps_each_error_class(exc, code, message):
    assert _CAPACITY.status_for(exc) == (code, message)


def test_base_map_knows_no_capacity_errors():
    assert grpc_errors.status_for(_PoolFull("landing pool full")) == (
        grpc.StatusCode.INTERNAL, "internal error: _PoolFull: landing pool full")


def test_grpc_errors_refuses_sync_methods():
    with pytest.raises(TypeError, match="needs an async method"):
        grpc_errors(lambda self, request, context: None)


class _Failing(pdserve_pb2_grpc.DecodeServicer):
    """Unary and streaming methods that raise what the request names."""

    @staticmethod
    def _raise(request_id: str) -> None:
        if request_id == "bad":
            raise ValueError("max_tokens must be >= 1, got 0")
        if request_id == "full":
            raise _NoBlocks("decode pod has 0 free blocks, 3 needed")

    @_CAPACITY
    async def Abort(self, request, context):
        self._raise(request.request_id)
        return pdserve_pb2.AbortResponse(found=True)

    @_CAPACITY
    async def Generate(self, request, context):
        yield pdserve_pb2.DecodeGenerateResponse(tokens=pdserve_pb2.DecodeTokens(first_index=0))
        self._raise(request.request_id)
        yield pdserve_pb2.DecodeGenerateResponse(tokens=pdserve_pb2.DecodeTokens(first_index=1))


@pytest.mark.timeout(30)
def test_decorated_servicer_sends_mapped_codes():
    async def scenario() -> None:
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_DecodeServicer_to_server(_Failing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pdserve_pb2_grpc.DecodeStub(channel)
                ok = await stub.Abort(pdserve_pb2.AbortRequest(request_id="fine"))
                assert ok.found is True
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Abort(pdserve_pb2.AbortRequest(request_id="bad"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "max_tokens must be >= 1, got 0"

                call = stub.Generate(pdserve_pb2.DecodeGenerateRequest(request_id="full"))
                first = await call.read()
                assert first.tokens.first_index == 0
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert err.value.details() == "decode pod has 0 free blocks, 3 needed"
        finally:
            await server.stop(None)

    asyncio.run(scenario())


class _Stopped(RuntimeError):
    pass


def test_extended_map_adds_entries_and_leaves_the_original_alone():
    stopped = _CAPACITY.extended(((_Stopped, grpc.StatusCode.UNAVAILABLE),))
    assert stopped.status_for(_Stopped("engine loop is stopped")) == (
        grpc.StatusCode.UNAVAILABLE, "engine loop is stopped")
    assert stopped.status_for(_PoolFull("full"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _CAPACITY.status_for(_Stopped("x"))[0] == grpc.StatusCode.INTERNAL
