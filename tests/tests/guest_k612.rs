//! The Linux 6.12 guest (Debian trixie's kernel, nvme-cli 2.13, tlshd): its kernel NVMe/TCP
//! target and kernel NVMe/TCP host authenticate each other with DH-HMAC-CHAP and refuse wrong
//! or missing keys, then connect over TLS 1.3 with a retained PSK from the .nvme keyring through
//! tlshd, refusing plain TCP on the port that requires TLS. One boot runs both parts
//! (`tests/interop/guest-scripts/nvmet-tcp-auth-tls.sh`).
//!
//! Needs the guest prepared by `tests/interop/setup.sh --with-k612` and `NVMEOF_INTEROP=1`;
//! without it the test prints why it did nothing.

use nvmeof_tests::{
    GuestKernel, assert_console_has, interop_script, run_guest, skip_without_interop,
};

#[test]
fn k612_kernel_peers_dhchap_and_tls() {
    if skip_without_interop() {
        return;
    }
    let console = run_guest(
        GuestKernel::Linux612
            .guest_sh("run")
            .args(["--timeout", "300", "--fail-on-kernel-trace"])
            .arg(interop_script("nvmet-tcp-auth-tls.sh")),
    );
    assert_console_has(
        &console,
        &[
            "running /test.sh (kernel 6.12.",
            "qid 0: authenticated with hash hmac(sha256) dhgroup ffdhe2048",
            "refused as expected: wrong host key",
            "refused as expected: wrong controller key",
            "refused as expected: no key",
            "PASS: DH-HMAC-CHAP between the kernel host and the kernel target",
            "Inserted TLS key",
            "addr_tsas tls1.3, addr_treq required",
            "refused as expected: plain TCP to a port that requires TLS",
            "Session description: (TLS1.3)",
            "Handshake with localhost (127.0.0.1) was successful",
            "PASS: TLS between the kernel host and the kernel target",
        ],
    );
}
