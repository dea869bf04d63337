#!/usr/bin/env python3
"""Known-answer vectors for nvme-auth, computed with the Python standard library only.

Run `python3 gen.py > vectors.txt`. Each output line is `name value`; byte strings are hex,
text is written as is. Every formula is written here from the specifications (NVMe Base 2.0
section 8.13.5, NVMe/TCP 1.0 section 3.6.1, RFC 7919, RFC 5869), independently of the Rust code.
"""
import base64
import hashlib
import hmac
import struct
import zlib

HASHES = {1: hashlib.sha256, 2: hashlib.sha384, 3: hashlib.sha512}
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:3b2a1c0e-1111-4222-8333-944455556666"
SUBNQN = "nqn.2024-01.io.nvmeof-direct:kat"

out = []


def emit(name, value):
    if isinstance(value, (bytes, bytearray)):
        value = value.hex()
    out.append(f"{name} {value}")


def pattern(n, seed):
    return bytes((seed + 7 * i) & 0xFF for i in range(n))


# --- RFC 7919 groups, derived from the formula, checked to be safe primes -----------------
def e_fixed(bits):
    """floor(e * 2^bits) by the series sum 1/k!, with guard bits."""
    guard = 64
    one = 1 << (bits + guard)
    total, term, k = 0, one, 0
    while term:
        total += term
        k += 1
        term //= k
    return total >> guard


def is_probable_prime(n, bases=(2, 3, 5, 7, 11, 13, 17, 19, 23, 29)):
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


GROUPS = {1: (2048, 560316), 2: (3072, 2625351), 3: (4096, 5736041), 4: (6144, 15705020), 5: (8192, 10965728)}
PRIMES = {}
for gid, (b, x) in GROUPS.items():
    p = 2**b - 2 ** (b - 64) + (e_fixed(b - 130) + x) * 2**64 - 1
    assert p.bit_length() == b
    assert is_probable_prime(p, (2, 3)) and is_probable_prime((p - 1) // 2, (2, 3)), gid
    PRIMES[gid] = p
    emit(f"ffdhe{b}.prime", p.to_bytes(b // 8, "big"))

# --- DHHC-1 secrets -----------------------------------------------------------------------
def dhhc1(key, xx):
    crc = zlib.crc32(key) & 0xFFFFFFFF
    return f"DHHC-1:{xx:02d}:{base64.b64encode(key + struct.pack('<I', crc)).decode()}:"


def transform(key, xx, nqn):
    if xx == 0:
        return key
    return hmac.new(key, nqn.encode() + b"NVMe-over-Fabrics", HASHES[xx]).digest()


for n, xx in [(32, 0), (32, 1), (48, 2), (64, 3), (64, 1)]:
    key = pattern(n, n + xx)
    name = f"dhhc1.{n}.{xx:02d}"
    emit(f"{name}.key", key)
    emit(f"{name}.crc", struct.pack("<I", zlib.crc32(key) & 0xFFFFFFFF))
    emit(f"{name}.secret", dhhc1(key, xx))
    emit(f"{name}.transformed_host", transform(key, xx, HOSTNQN))
    emit(f"{name}.transformed_ctrl", transform(key, xx, SUBNQN))

emit("hostnqn", HOSTNQN)
emit("subnqn", SUBNQN)

# --- Responses ----------------------------------------------------------------------------
HOST_KEY = pattern(32, 11)  # used with transform 01
CTRL_KEY = pattern(48, 23)  # used with transform 02
emit("resp.host_secret", dhhc1(HOST_KEY, 1))
emit("resp.ctrl_secret", dhhc1(CTRL_KEY, 2))
SEQ1, SEQ2, TID = 0x01020304, 0xA0B0C0D0, 0x0102


def host_response(h, key, chal, seq, tid, sc_c=0):
    msg = chal + struct.pack("<IH", seq, tid) + bytes([sc_c]) + b"HostHost"
    msg += HOSTNQN.encode() + b"\x00" + SUBNQN.encode()
    return hmac.new(key, msg, HASHES[h]).digest()


def ctrl_response(h, key, chal, seq, tid):
    msg = chal + struct.pack("<IH", seq, tid) + b"\x00" + b"Controller"
    msg += SUBNQN.encode() + b"\x00" + HOSTNQN.encode()
    return hmac.new(key, msg, HASHES[h]).digest()


def augmented(h, session_key, chal):
    return hmac.new(HASHES[h](session_key).digest(), chal, HASHES[h]).digest()


for h in (1, 2, 3):
    hl = HASHES[h]().digest_size
    c1, c2 = pattern(hl, 0x31 + h), pattern(hl, 0x52 + h)
    emit(f"resp.{h}.c1", c1)
    emit(f"resp.{h}.c2", c2)
    emit(f"resp.{h}.host", host_response(h, transform(HOST_KEY, 1, HOSTNQN), c1, SEQ1, TID))
    emit(f"resp.{h}.ctrl", ctrl_response(h, transform(CTRL_KEY, 2, SUBNQN), c2, SEQ2, TID))
emit("resp.seq1", f"{SEQ1}")
emit("resp.seq2", f"{SEQ2}")
emit("resp.tid", f"{TID}")

# --- FFDHE ----------------------------------------------------------------------------------
def pad(v, gid):
    return v.to_bytes(GROUPS[gid][0] // 8, "big")


for gid in (1, 2):
    p = PRIMES[gid]
    b = GROUPS[gid][0]
    x = int.from_bytes(pattern(32, 0x41 + gid), "big")
    y = int.from_bytes(pattern(32, 0x63 + gid), "big")
    gx, gy = pow(2, x, p), pow(2, y, p)
    emit(f"dh.{b}.x", x.to_bytes(32, "big"))
    emit(f"dh.{b}.y", y.to_bytes(32, "big"))
    emit(f"dh.{b}.gx", pad(gx, gid))
    emit(f"dh.{b}.gy", pad(gy, gid))
    shared = pow(gy, x, p)
    assert shared == pow(gx, y, p)
    emit(f"dh.{b}.shared", pad(shared, gid))
    # A private value whose shared secret has a leading zero byte: it must stay padded.
    z = y
    while pow(gx, z, p) >> (b - 8):
        z += 1
    emit(f"dh.{b}.z_leading_zero", z.to_bytes(32, "big"))
    emit(f"dh.{b}.gz", pad(pow(2, z, p), gid))
    emit(f"dh.{b}.shared_leading_zero", pad(pow(gx, z, p), gid))
    for h in (1, 2, 3):
        hl = HASHES[h]().digest_size
        c1 = pattern(hl, 0x31 + h)
        aug = augmented(h, pad(shared, gid), c1)
        emit(f"dh.{b}.aug.{h}", aug)
        emit(f"dh.{b}.host_response.{h}",
             host_response(h, transform(HOST_KEY, 1, HOSTNQN), aug, SEQ1, TID))

# --- TLS PSK (NVMe/TCP 1.0 section 3.6.1.3; libnvme's encoding of the HKDF info) ------------
def hkdf(hashf, ikm, info, length):
    prk = hmac.new(b"\x00" * hashf().digest_size, ikm, hashf).digest()
    okm, t, i = b"", b"", 1
    while len(okm) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashf).digest()
        okm += t
        i += 1
    return okm[:length]


def psk_interchange(key, hmac_id):
    crc = zlib.crc32(key) & 0xFFFFFFFF
    return f"NVMeTLSkey-1:{hmac_id:02x}:{base64.b64encode(key + struct.pack('<I', crc)).decode()}:"


for n, hmac_id in [(32, 0), (32, 1), (48, 2), (48, 0)]:
    configured = pattern(n, 0x70 + hmac_id)
    cipher = hmac_id if hmac_id else {32: 1, 48: 2}[n]
    hashf = HASHES[cipher]
    name = f"tls.{n}.{hmac_id:02x}"
    emit(f"{name}.configured", configured)
    emit(f"{name}.interchange", psk_interchange(configured, hmac_id))
    if hmac_id == 0:
        retained = configured
    else:
        info = struct.pack("<H", n) + b"tls13 " + b"HostNQN" + HOSTNQN.encode()
        retained = hkdf(HASHES[hmac_id], configured, info, n)
    emit(f"{name}.retained", retained)
    ident0 = f"NVMe0R{cipher:02d} {HOSTNQN} {SUBNQN}"
    info0 = struct.pack("<H", n) + b"tls13 " + b"nvme-tls-psk" + ident0.encode()
    emit(f"{name}.identity0", ident0)
    emit(f"{name}.tls_psk0", hkdf(hashf, retained, info0, n))
    digest = base64.b64encode(
        hmac.new(retained, f"{HOSTNQN} {SUBNQN} NVMe-over-Fabrics".encode(), hashf).digest()
    ).decode()
    ident1 = f"NVMe1R{cipher:02d} {HOSTNQN} {SUBNQN} {digest}"
    info1 = struct.pack("<H", n) + b"tls13 " + b"nvme-tls-psk" + f"{cipher:02d} ".encode()
    info1 += digest.encode()
    emit(f"{name}.digest", digest)
    emit(f"{name}.identity1", ident1)
    emit(f"{name}.tls_psk1", hkdf(hashf, retained, info1, n))

# --- Published examples --------------------------------------------------------------------
# The DH-HMAC-CHAP secret of the NVMe Base specification's example, and the configured PSK of
# the NVMe/TCP Transport specification's example (also used by blktests).
SPEC_DHHC1 = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:"
SPEC_TLS = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"
for name, s in [("published.dhhc1", SPEC_DHHC1), ("published.tls", SPEC_TLS)]:
    raw = base64.b64decode(s.split(":")[2])
    key, crc = raw[:-4], raw[-4:]
    assert zlib.crc32(key).to_bytes(4, "little") == crc
    emit(f"{name}.string", s)
    emit(f"{name}.key", key)
    emit(f"{name}.crc", crc)
for xx in (1, 2, 3):
    key = base64.b64decode(SPEC_DHHC1.split(":")[2])[:-4]
    emit(f"published.dhhc1.transformed_host.{xx:02d}", transform(key, xx, HOSTNQN))
tls_key = base64.b64decode(SPEC_TLS.split(":")[2])[:-4]
tls_retained = hkdf(hashlib.sha256, tls_key, struct.pack("<H", 32) + b"tls13 HostNQN" + HOSTNQN.encode(), 32)
emit("published.tls.retained", tls_retained)
ident0 = f"NVMe0R01 {HOSTNQN} {SUBNQN}"
emit("published.tls.tls_psk0",
     hkdf(hashlib.sha256, tls_retained, struct.pack("<H", 32) + b"tls13 nvme-tls-psk" + ident0.encode(), 32))

print("\n".join(out))
