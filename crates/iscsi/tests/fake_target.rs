//! The session against a scripted target on a real socket: what a refused login, a silent
//! target, a dropped connection and malformed PDUs give (one error each, never a hang), and
//! a read and a write with Data-In, R2T and Data-Out.

use std::time::Duration;

use iscsi_initiator::pdu::{BHS_LEN, Bhs, padded};
use iscsi_initiator::{DataDir, Error, Session, SessionConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the scripted target does with each SCSI command (after a successful login).
#[derive(Clone, Copy)]
enum Script {
    /// Refuses the login: target not found.
    RefuseLogin,
    /// Accepts the connection and never answers.
    Silent,
    /// Logs in, then closes the connection on the first command.
    DropOnCommand,
    /// Logs in, then answers the first command with a header claiming 16 MiB of data (beyond the 256 KiB
    /// it declared).
    HugeSegment,
    /// Logs in, then sends Data-In beyond the command's buffer.
    DataBeyondBuffer,
    /// Logs in and serves reads and writes of a 1 MiB disk of 512-byte blocks; writes beyond
    /// the first 4 KiB are asked for with an R2T; LUN 3 does not exist.
    Disk,
}

async fn read_pdu(s: &mut TcpStream) -> Option<(Bhs, Vec<u8>)> {
    let mut h = [0u8; BHS_LEN];
    s.read_exact(&mut h).await.ok()?;
    let h = Bhs::read_from(&h);
    let mut data = vec![0u8; padded(h.data_len())];
    s.read_exact(&mut data).await.ok()?;
    data.truncate(h.data_len());
    Some((h, data))
}

fn target_header(op: u8, flags: u8, itt: u32, stat_sn: u32, data_len: usize) -> [u8; BHS_LEN] {
    let mut b = [0u8; BHS_LEN];
    b[0] = op;
    b[1] = flags;
    b[5] = (data_len >> 16) as u8;
    b[6] = (data_len >> 8) as u8;
    b[7] = data_len as u8;
    b[16..20].copy_from_slice(&itt.to_be_bytes());
    b[24..28].copy_from_slice(&stat_sn.to_be_bytes());
    b[28..32].copy_from_slice(&1u32.to_be_bytes());
    b[32..36].copy_from_slice(&1000u32.to_be_bytes());
    b
}

async fn send(s: &mut TcpStream, h: [u8; BHS_LEN], data: &[u8]) {
    let mut out = h.to_vec();
    out.extend_from_slice(data);
    out.resize(BHS_LEN + padded(data.len()), 0);
    let _ = s.write_all(&out).await;
}

fn scsi_response(itt: u32, stat_sn: u32, status: u8, sense: &[u8]) -> ([u8; BHS_LEN], Vec<u8>) {
    let mut seg = Vec::new();
    if !sense.is_empty() {
        seg.extend_from_slice(&(sense.len() as u16).to_be_bytes());
        seg.extend_from_slice(sense);
    }
    let mut h = target_header(0x21, 0x80, itt, stat_sn, seg.len());
    h[3] = status;
    (h, seg)
}

async fn serve(mut s: TcpStream, script: Script) {
    let mut stat_sn = 10u32;
    let mut disk = vec![0u8; 1 << 20];
    // Writes waiting for their R2T'd data: (itt, lba, length, received so far).
    let mut writes: Vec<(u32, usize, usize, Vec<u8>)> = Vec::new();
    while let Some((h, data)) = read_pdu(&mut s).await {
        let itt = h.itt.get();
        stat_sn += 1;
        match h.op() {
            0x03 => {
                let mut r = target_header(0x23, h.flags, itt, stat_sn, 0);
                r[8..16].copy_from_slice(&h.lun);
                match script {
                    Script::RefuseLogin => {
                        r[36] = 2;
                        r[37] = 3;
                        send(&mut s, r, &[]).await;
                        return;
                    }
                    Script::Silent => return std::future::pending().await,
                    _ => {}
                }
                let text: &[u8] = if h.flags & 0x0c == 0x04 {
                    b"MaxRecvDataSegmentLength=65536\0FirstBurstLength=4096\0ImmediateData=Yes\0InitialR2T=Yes\0"
                } else {
                    b"AuthMethod=None\0"
                };
                r[5..8].copy_from_slice(&[0, 0, text.len() as u8]);
                send(&mut s, r, text).await;
            }
            0x01 => {
                let cdb = &h.tail;
                let lun = h.lun[1];
                match script {
                    Script::DropOnCommand => return,
                    Script::HugeSegment => {
                        let r = target_header(0x25, 0x81, itt, stat_sn, 0xff_ffff);
                        send(&mut s, r, &[]).await;
                        std::future::pending::<()>().await;
                    }
                    Script::DataBeyondBuffer => {
                        let mut r = target_header(0x25, 0x81, itt, stat_sn, 512);
                        r[40..44].copy_from_slice(&(1u32 << 20).to_be_bytes());
                        send(&mut s, r, &[0; 512]).await;
                        std::future::pending::<()>().await;
                    }
                    _ => {}
                }
                if lun == 3 {
                    let mut sense = [0u8; 18];
                    sense[0] = 0x70;
                    sense[2] = 0x05;
                    sense[12] = 0x25;
                    let (r, seg) = scsi_response(itt, stat_sn, 0x02, &sense);
                    send(&mut s, r, &seg).await;
                    continue;
                }
                match cdb[0] {
                    0x9e => {
                        let mut cap = [0u8; 32];
                        cap[0..8].copy_from_slice(&((disk.len() / 512 - 1) as u64).to_be_bytes());
                        cap[8..12].copy_from_slice(&512u32.to_be_bytes());
                        let r = target_header(0x25, 0x81, itt, stat_sn, 32);
                        send(&mut s, r, &cap).await;
                    }
                    0x88 => {
                        let lba = u64::from_be_bytes(cdb[2..10].try_into().unwrap()) as usize;
                        let n = u32::from_be_bytes(cdb[10..14].try_into().unwrap()) as usize * 512;
                        // Two Data-In PDUs, the status in the last.
                        let half = n / 2;
                        let first = target_header(0x25, 0x00, itt, 0, half);
                        send(&mut s, first, &disk[lba * 512..lba * 512 + half]).await;
                        let mut last = target_header(0x25, 0x81, itt, stat_sn, n - half);
                        last[40..44].copy_from_slice(&(half as u32).to_be_bytes());
                        send(&mut s, last, &disk[lba * 512 + half..lba * 512 + n]).await;
                    }
                    0x8a => {
                        let lba = u64::from_be_bytes(cdb[2..10].try_into().unwrap()) as usize;
                        let n = u32::from_be_bytes(cdb[10..14].try_into().unwrap()) as usize * 512;
                        let mut got = data.clone();
                        if got.len() < n {
                            let mut r2t = target_header(0x31, 0x80, itt, 0, 0);
                            r2t[20..24].copy_from_slice(&0x77u32.to_be_bytes());
                            r2t[40..44].copy_from_slice(&(got.len() as u32).to_be_bytes());
                            r2t[44..48].copy_from_slice(&((n - got.len()) as u32).to_be_bytes());
                            send(&mut s, r2t, &[]).await;
                            got.reserve(n);
                            writes.push((itt, lba, n, got));
                            continue;
                        }
                        disk[lba * 512..lba * 512 + n].copy_from_slice(&got);
                        let (r, seg) = scsi_response(itt, stat_sn, 0, &[]);
                        send(&mut s, r, &seg).await;
                    }
                    _ => {
                        let (r, seg) = scsi_response(itt, stat_sn, 0, &[]);
                        send(&mut s, r, &seg).await;
                    }
                }
            }
            0x05 => {
                let Some(i) = writes.iter().position(|w| w.0 == itt) else {
                    return;
                };
                let off = u32::from_be_bytes(h.tail[8..12].try_into().unwrap()) as usize;
                assert_eq!(h.word20.get(), 0x77, "Data-Out quotes the R2T's TTT");
                assert_eq!(off, writes[i].3.len(), "Data-Out in order");
                writes[i].3.extend_from_slice(&data);
                if h.flags & 0x80 != 0 {
                    let (itt, lba, n, got) = writes.remove(i);
                    assert_eq!(got.len(), n);
                    disk[lba * 512..lba * 512 + n].copy_from_slice(&got);
                    let (r, seg) = scsi_response(itt, stat_sn, 0, &[]);
                    send(&mut s, r, &seg).await;
                }
            }
            0x06 => {
                let r = target_header(0x26, 0x80, itt, stat_sn, 0);
                send(&mut s, r, &[]).await;
                return;
            }
            _ => {}
        }
    }
}

async fn target(script: Script) -> SessionConfig {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, script));
        }
    });
    let mut cfg = SessionConfig::new(addr.to_string(), "iqn.2026-11.io.example:disk");
    cfg.login_timeout = Duration::from_millis(500);
    cfg.command_timeout = Duration::from_secs(2);
    cfg
}

fn one_line(e: &Error) -> String {
    let s = e.to_string();
    assert_eq!(s.lines().count(), 1, "{s}");
    s
}

#[tokio::test]
async fn refused_and_silent_logins_fail_with_one_line() {
    let cfg = target(Script::RefuseLogin).await;
    let e = Session::connect(&cfg).await.err().unwrap();
    assert!(one_line(&e).contains("target not found"), "{e}");
    let cfg = target(Script::Silent).await;
    let e = Session::connect(&cfg).await.err().unwrap();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    // Nobody listening.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let e = Session::connect(&SessionConfig::new(
        addr.to_string(),
        "iqn.2026-11.io.example:x",
    ))
    .await
    .err()
    .unwrap();
    assert!(one_line(&e).contains("cannot connect"), "{e}");
}

#[tokio::test]
async fn broken_targets_end_the_session_with_the_reason() {
    for (script, needle) in [
        (Script::DropOnCommand, "closed the connection"),
        (Script::HugeSegment, "exceeds the limit"),
        (Script::DataBeyondBuffer, "beyond the 32 byte buffer"),
    ] {
        let cfg = target(script).await;
        let s = Session::connect(&cfg).await.unwrap();
        let e = s.open_lun(1).await.unwrap_err();
        assert!(matches!(e, Error::ConnectionLost { .. }), "{e}");
        assert!(one_line(&e).contains(needle), "{e}");
        // Later commands fail at once with the same reason.
        let (r, _) = s.command(1, [0; 16], DataDir::None, Vec::new()).await;
        assert!(r.unwrap_err().to_string().contains(needle));
    }
}

#[tokio::test]
async fn reads_writes_r2t_and_a_missing_lun() {
    let cfg = target(Script::Disk).await;
    let s = Session::connect(&cfg).await.unwrap();
    let n = s.negotiated();
    assert_eq!((n.max_send_segment, n.first_burst_length), (65_536, 4096));
    assert!(n.initial_r2t && n.immediate_data);
    let e = s.open_lun(3).await.unwrap_err();
    assert!(one_line(&e).contains("LUN 3 does not exist"), "{e}");
    let lun = s.open_lun(1).await.unwrap();
    assert_eq!((lun.capacity.blocks, lun.capacity.block_size), (2048, 512));
    // 16 KiB: 4 KiB immediate, the rest after an R2T.
    let data: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 3) as u8).collect();
    let (r, back) = s.write(&lun, 8, data.clone()).await;
    r.unwrap();
    assert_eq!(back, data, "the buffer comes back");
    let (r, got) = s.read(&lun, 8, vec![0; 16384]).await;
    r.unwrap();
    assert_eq!(got, data);
    // Out of range and odd lengths are refused before anything is sent.
    let (r, _) = s.read(&lun, 2047, vec![0; 1024]).await;
    assert!(r.unwrap_err().to_string().contains("beyond"));
    let (r, _) = s.read(&lun, 0, vec![0; 100]).await;
    assert!(r.is_err());
    s.logout().await.unwrap();
}
