//! In-band authentication (DH-HMAC-CHAP) of one queue during its set-up: when the Connect
//! completion asks for it (AUTHREQ), the host runs [`nvme_auth::HostAuth`] in Authentication
//! Send/Receive commands on that queue (through [`Admin`], as set-up commands go) before
//! anything else. Every queue of a controller, the
//! admin queue and each I/O queue, authenticates on its own.

use nvme_auth::{HostAuth, HostConfig, HostEvent, HostNext, HostStep};
use nvme_spec::FabricsCommand;
use nvme_spec::auth::AuthCommand;
use nvme_spec::fabrics::CONNECT_AUTHREQ_ASCR;
use tracing::debug;

use crate::admin::Admin;
use crate::queue_core::Retry;
use crate::{DhchapSecrets, Error};

/// The Authentication Send or Receive command `cmd` describes.
fn auth_sqe(cmd: AuthCommand) -> nvme_spec::Sqe {
    let mut sqe = FabricsCommand::AuthSend.encode(0);
    cmd.write_to_sqe(&mut sqe);
    sqe
}

/// Runs the DH-HMAC-CHAP transaction on queue `qid`, whose Connect completion DW0 was `dw0`.
pub(crate) async fn authenticate(
    conn: &mut impl Admin,
    qid: u16,
    dw0: u32,
    subnqn: &str,
    hostnqn: &str,
    dhchap: Option<&DhchapSecrets>,
) -> Result<(), Error> {
    let fail = |reason: String| Error::Auth { qid, reason };
    if dw0 & CONNECT_AUTHREQ_ASCR != 0 {
        return Err(fail(
            "the controller requires secure channel concatenation, which is not supported".into(),
        ));
    }
    let Some(keys) = dhchap else {
        return Err(fail(
            "the controller requires DH-HMAC-CHAP authentication and no host secret was given \
             (--dhchap-secret)"
                .into(),
        ));
    };
    let mut cfg = HostConfig::new(hostnqn, subnqn, keys.host.clone());
    cfg.ctrl_key = keys.ctrl.clone();
    // Queues of one controller authenticate concurrently: the queue ID tells them apart.
    let mut host = HostAuth::new(cfg, qid);
    let mut step = host.handle(HostEvent::Start, &mut rand::rng());
    loop {
        let HostStep { send, next } = step;
        if let Some(msg) = send {
            let sqe = auth_sqe(AuthCommand::send(msg.len() as u32));
            let sent = conn.run(sqe, &msg, 0, Retry::Never).await;
            // A Failure2 is sent as a courtesy: what failed is what the caller hears about.
            if let (Err(e), HostNext::Receive | HostNext::Authenticated(_)) = (sent, &next) {
                return Err(fail(e.to_string()));
            }
        }
        match next {
            HostNext::Receive => {
                let len = nvme_auth::MAX_MESSAGE_LEN;
                let sqe = auth_sqe(AuthCommand::receive(len as u32));
                let (_, data) = conn
                    .run(sqe, &[], len as u32, Retry::Never)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                step = host.handle(HostEvent::Received(&data), &mut rand::rng());
            }
            HostNext::Authenticated(o) => {
                debug!(
                    qid,
                    hash = o.hash.name(),
                    dhgroup = o.dh_group.name(),
                    bidirectional = o.bidirectional,
                    "queue authenticated"
                );
                return Ok(());
            }
            HostNext::Failed(e) => return Err(fail(e.to_string())),
        }
    }
}
