"""Demo TLS material for a deployment, written with the ``cryptography`` package
(``generate_certificates``, ``generate_node_keys``)::

    python -m florg_tools.deploy.certs --out certs --san 10.200.1.1 --san superlink
        [--node-keys 3] [--days 365] [--force]

writes ``ca.crt`` / ``ca.key`` (a self-signed CA, RSA 2048: for every SuperNode, the
``flwr`` CLI and the SuperLink), ``server.pem`` / ``server.key`` (the SuperLink's
certificate, valid for 127.0.0.1, ::1, localhost and every ``--san``) and, with
``--node-keys N``, ``node-keys/node-I`` / ``node-I.pub``, EC P-384 key pairs in OpenSSH
format for SuperNode authentication. For demos and tests; in production use your
organisation's CA (docs/deploy-superlink.md, "Across machines").
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from florg_tools.deploy.commands import DeployConfigError, ServerTLS

__all__ = [
    "DEFAULT_SANS",
    "CertificateSet",
    "NodeKey",
    "certificate_sans",
    "generate_certificates",
    "generate_node_keys",
    "main",
    "require_files",
]

DEFAULT_SANS: tuple[str, ...] = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class CertificateSet:
    """Paths of the generated CA and SuperLink server certificate."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    def server_tls(self) -> ServerTLS:
        return ServerTLS(self.ca_cert, self.server_cert, self.server_key)


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's authentication key pair (OpenSSH format)."""

    private_key: Path
    public_key: Path


def require_files(*paths: str | os.PathLike[str], what: str = "certificate") -> None:
    """Raise DeployConfigError naming the first missing/unreadable file."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DeployConfigError(f"{what} file {p} does not exist (or is not a file)")
        if not os.access(p, os.R_OK):
            raise DeployConfigError(f"{what} file {p} is not readable")


def _general_name(san: str) -> x509.GeneralName:
    text = san.strip().strip("[]")
    if not text:
        raise DeployConfigError("empty subject alternative name")
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    if any(c in text for c in " /:@") or text.startswith(".") or text.endswith("."):
        raise DeployConfigError(f"subject alternative name {san!r} is neither an IP nor a DNS name")
    return x509.DNSName(text)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _unique(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(item.strip().strip("[]"), None)
    return list(seen)


def generate_certificates(
    out: str | os.PathLike[str],
    sans: Sequence[str] = (),
    *,
    days: int = 365,
    overwrite: bool = False,
) -> CertificateSet:
    """Write ``ca.crt``, ``ca.key``, ``server.pem``, ``server.key`` under ``out``.

    The server certificate is valid for ``DEFAULT_SANS`` plus ``sans`` (IP addresses or DNS
    names). Existing files are kept (and returned) unless ``overwrite``; a set whose
    server certificate lacks one of ``sans`` raises instead of silently not matching.
    """
    if days < 1:
        raise DeployConfigError(f"days must be >= 1, got {days}")
    directory = Path(out).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    names = _unique([*DEFAULT_SANS, *sans])
    general_names = [_general_name(n) for n in names]
    result = CertificateSet(
        directory,
        directory / "ca.crt",
        directory / "ca.key",
        directory / "server.pem",
        directory / "server.key",
    )
    files = (result.ca_cert, result.ca_key, result.server_cert, result.server_key)
    if not overwrite and any(p.exists() for p in files):
        require_files(*files)
        missing = sorted(set(names) - set(certificate_sans(result.server_cert)))
        if missing:
            raise DeployConfigError(
                f"{result.server_cert} exists but is not valid for {', '.join(missing)}; "
                "regenerate with --force (overwrite=True) and the full --san list"
            )
        return result

    now = dt.datetime.now(dt.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FLoRG demo CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[-1])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(result.ca_key, _pem_key(ca_key))
    _write_private(result.server_key, _pem_key(server_key))
    result.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    result.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    return result


def certificate_sans(path: str | os.PathLike[str]) -> list[str]:
    """The subject alternative names (IPs and DNS names, as text) of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    ips = [str(ip) for ip in ext.get_values_for_type(x509.IPAddress)]
    return ips + list(ext.get_values_for_type(x509.DNSName))


def generate_node_keys(
    out: str | os.PathLike[str], count: int, *, overwrite: bool = False
) -> list[NodeKey]:
    """EC P-384 key pairs ``out/node-I`` (OpenSSH private key, mode 0600) and
    ``out/node-I.pub`` for SuperNode authentication; existing pairs are kept."""
    if count < 0:
        raise DeployConfigError(f"node key count must be >= 0, got {count}")
    directory = Path(out).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    keys = []
    for i in range(count):
        pair = NodeKey(directory / f"node-{i}", directory / f"node-{i}.pub")
        if overwrite or not (pair.private_key.is_file() and pair.public_key.is_file()):
            key = ec.generate_private_key(ec.SECP384R1())
            private = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
            public = key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            _write_private(pair.private_key, private)
            pair.public_key.write_bytes(public + f" florg-node-{i}\n".encode())
        keys.append(pair)
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.deploy.certs",
        description="Generate a demo CA, the SuperLink's TLS certificate and node keys.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="IP address or DNS name the SuperLink is reached at (repeatable; "
        f"{', '.join(DEFAULT_SANS)} are always included)",
    )
    parser.add_argument("--node-keys", type=int, default=0, metavar="N", help="node key pairs")
    parser.add_argument("--days", type=int, default=365, help="validity in days")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)
    try:
        certs = generate_certificates(args.out, args.san, days=args.days, overwrite=args.force)
        keys = generate_node_keys(args.out / "node-keys", args.node_keys, overwrite=args.force)
    except DeployConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"CA certificate:     {certs.ca_cert}")
    print(f"server certificate: {certs.server_cert} (SANs: "
          f"{', '.join(certificate_sans(certs.server_cert))})")  # fmt: skip
    print(f"server key:         {certs.server_key}")
    for key in keys:
        print(f"node key:           {key.private_key} (+ .pub)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
