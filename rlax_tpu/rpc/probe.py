"""A health probe for any of the services: calls its Health RPC with the service's credentials.

    python -m rlax_tpu.rpc.probe SERVICE ENDPOINT [--token_file=F] [--tls_cert_file=F]
                                 [--server_name=NAME] [--timeout_s=5]

SERVICE is Trainer, Inference, ParamServer or Verifier. Exit status 0 when it answers serving
within the timeout, 1 otherwise (the reason on stderr): Kubernetes runs it as the pods' exec
probe, since a built-in gRPC probe can present neither a token nor trust a private certificate.
With --lead_only, a pod that is not process 0 of its job (JOB_COMPLETION_INDEX != 0: a
jax.distributed follower, which serves nothing) passes: its failures surface as its exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from rlax_tpu.rpc import common_pb2
from rlax_tpu.rpc.transport import Credentials, CredentialsError, make_channel

SERVICES = ("Trainer", "Inference", "ParamServer", "Verifier")


def probe(
    service: str,
    endpoint: str,
    credentials: Credentials,
    *,
    server_name: str = "",
    timeout_s: float = 5.0,
) -> common_pb2.HealthReply:
    """The service's HealthReply; raises grpc.RpcError if it does not answer in time."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    channel = make_channel(endpoint, credentials=credentials, server_name=server_name)
    try:
        health = channel.unary_unary(
            f"/rlax_tpu.{service}/Health",
            request_serializer=common_pb2.Empty.SerializeToString,
            response_deserializer=common_pb2.HealthReply.FromString,
        )
        return health(common_pb2.Empty(), timeout=timeout_s)
    finally:
        channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlax_tpu.rpc.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("endpoint", help="host:port")
    parser.add_argument("--token_file", default="")
    parser.add_argument("--tls_cert_file", default="")
    parser.add_argument("--server_name", default="", help="name on the server's certificate")
    parser.add_argument("--timeout_s", type=float, default=5.0)
    parser.add_argument(
        "--wait_s",
        type=float,
        default=0.0,
        help="retry every 5 s until it serves or this many seconds pass",
    )
    parser.add_argument(
        "--lead_only",
        action="store_true",
        help="pass on pods other than process 0 of an Indexed job",
    )
    parser.add_argument(
        "--lead_job_only",
        action="store_true",
        help="with --lead_only, pass on every pod of jobs other than job 0 too (one "
        "jax.distributed job over a job per slice: only job 0's process 0 serves)",
    )
    args = parser.parse_args(argv)
    follower = os.environ.get("JOB_COMPLETION_INDEX", "0") != "0" or (
        args.lead_job_only and os.environ.get("JOB_INDEX", "0") != "0"
    )
    if args.lead_only and follower:
        print(f"{args.service}: a follower process; nothing to probe")
        return 0
    creds = Credentials(auth_token_file=args.token_file, tls_cert_file=args.tls_cert_file)
    deadline = time.monotonic() + args.wait_s
    while True:
        try:
            reply = probe(
                args.service,
                args.endpoint,
                creds,
                server_name=args.server_name,
                timeout_s=args.timeout_s,
            )
            problem = None if reply.serving else f"not serving: {reply.detail}"
        except CredentialsError as e:
            problem = f"unhealthy: {e}"
            deadline = 0.0  # a bad token file does not heal by waiting
        except grpc.RpcError as e:
            problem = f"unhealthy: {e.details()}"
        if problem is None:
            print(f"{args.service} at {args.endpoint}: serving ({reply.detail})")
            return 0
        if time.monotonic() >= deadline:
            print(f"{args.service} at {args.endpoint}: {problem}", file=sys.stderr)
            return 1
        time.sleep(5.0)


if __name__ == "__main__":
    sys.exit(main())
