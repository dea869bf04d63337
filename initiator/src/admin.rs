//! One admin API over both command paths: a connection being set up
//! ([`SetupConn`](crate::setup::SetupConn)) and a controller's running admin queue. Each
//! implements [`Admin::run`]; properties, Identify, features, log pages, enabling and the
//! CC.SHN shutdown are written once on top of it.

use std::time::Duration;

use nvme_spec::command::build;
use nvme_spec::fabrics::{Cc, csts, property};
use nvme_spec::{Cqe, FabricsCommand, Sqe};
use tokio::time::Instant;

use crate::Error;
use crate::queue_core::{DataDir, Request, Retry};

/// Delay between two polls of CSTS.
const CSTS_POLL: Duration = Duration::from_millis(20);

/// A request for one admin command: `data_out` goes to the controller, `data_in` bytes are
/// expected back.
pub(crate) fn admin_request(
    sqe: Sqe,
    data_out: &[u8],
    data_in: u32,
    retry: Retry,
    timeout: Duration,
) -> Result<Request, Error> {
    let len = u32::try_from(data_out.len())
        .map_err(|_| Error::InvalidArgument("transfer too large".into()))?
        .max(data_in);
    let dir = if !data_out.is_empty() {
        DataDir::FromHost
    } else if data_in > 0 {
        DataDir::ToHost
    } else {
        DataDir::None
    };
    Ok(Request {
        sqe,
        dir,
        len,
        retry,
        timeout: Some(timeout),
    })
}

/// Admin commands, whichever path carries them.
pub(crate) trait Admin {
    /// Runs one admin command: `data_out` to the controller, `data_in` bytes back. `retry`
    /// says what happens to it when a running queue loses its link (on a connection being
    /// set up a loss fails it). A completion with an error status is an [`Error::Status`].
    async fn run(
        &mut self,
        sqe: Sqe,
        data_out: &[u8],
        data_in: u32,
        retry: Retry,
    ) -> Result<(Cqe, Vec<u8>), Error>;

    /// Property Get (8 bytes when `size8`).
    async fn property_get(&mut self, offset: u32, size8: bool) -> Result<u64, Error> {
        let sqe = FabricsCommand::PropertyGet { size8, offset }.encode(0);
        let (cqe, _) = self.run(sqe, &[], 0, Retry::Never).await?;
        Ok(if size8 {
            cqe.value64()
        } else {
            u64::from(cqe.dw0.get())
        })
    }

    /// Property Set of a 4-byte property.
    async fn property_set(&mut self, offset: u32, value: u32) -> Result<(), Error> {
        let sqe = FabricsCommand::PropertySet {
            size8: false,
            offset,
            value: u64::from(value),
        }
        .encode(0);
        self.run(sqe, &[], 0, Retry::Never).await.map(|_| ())
    }

    /// Identify with the given CNS and NSID (4096 bytes).
    async fn identify(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>, Error> {
        let sqe = build::identify(0, cns, nsid);
        self.run(sqe, &[], 4096, Retry::Always)
            .await
            .map(|(_, d)| d)
    }

    /// Set Features; returns completion DW0.
    async fn set_features(&mut self, fid: u8, cdw11: u32) -> Result<u32, Error> {
        let sqe = build::set_features(0, fid, cdw11);
        self.run(sqe, &[], 0, Retry::Never)
            .await
            .map(|(c, _)| c.dw0.get())
    }

    /// Get Features (current value); returns completion DW0.
    async fn get_features(&mut self, fid: u8) -> Result<u32, Error> {
        let sqe = build::get_features(0, fid);
        self.run(sqe, &[], 0, Retry::Always)
            .await
            .map(|(c, _)| c.dw0.get())
    }

    /// Get Log Page: `len` bytes of log `lid` (namespace `nsid`) at byte `offset`.
    async fn get_log_page(
        &mut self,
        lid: u8,
        nsid: u32,
        len: u32,
        offset: u64,
    ) -> Result<Vec<u8>, Error> {
        let sqe = build::get_log_page(0, lid, nsid, len, offset);
        self.run(sqe, &[], len, Retry::Always).await.map(|(_, d)| d)
    }
}

/// Sets CC.EN and waits for CSTS.RDY, at most CAP.TO (and at least `min_wait`).
pub(crate) async fn enable<A: Admin>(
    a: &mut A,
    cap_timeout_ms: u32,
    min_wait: Duration,
) -> Result<(), Error> {
    a.property_set(property::CC, Cc::enable_value()).await?;
    let limit = Duration::from_millis(u64::from(cap_timeout_ms)).max(min_wait);
    let deadline = Instant::now() + limit;
    loop {
        let v = a.property_get(property::CSTS, false).await? as u32;
        if v & csts::CFS != 0 {
            return Err(Error::Refused(
                "the controller reports a fatal status (CSTS.CFS) after enable".into(),
            ));
        }
        if v & csts::RDY != 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::timeout(
                "CSTS.RDY after enabling the controller",
                limit,
            ));
        }
        tokio::time::sleep(CSTS_POLL).await;
    }
}

/// Requests a normal shutdown (CC.SHN) and waits for CSTS.SHST, at most `limit`.
pub(crate) async fn shutdown<A: Admin>(a: &mut A, limit: Duration) -> Result<(), Error> {
    let cc = a.property_get(property::CC, false).await? as u32;
    a.property_set(property::CC, Cc::shutdown_value(cc)).await?;
    let deadline = Instant::now() + limit;
    loop {
        let v = a.property_get(property::CSTS, false).await? as u32;
        if v & csts::SHST_MASK == csts::SHST_COMPLETE {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::timeout("CSTS.SHST after a shutdown request", limit));
        }
        tokio::time::sleep(CSTS_POLL).await;
    }
}
