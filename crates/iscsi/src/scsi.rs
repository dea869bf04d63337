//! The SCSI commands this initiator sends (SBC-4) and the status and sense data it decodes
//! (SPC-5).

use std::fmt;

/// SCSI status GOOD.
pub const STATUS_GOOD: u8 = 0x00;
/// SCSI status CHECK CONDITION: sense data follows.
pub const STATUS_CHECK_CONDITION: u8 = 0x02;

/// READ(16), SBC-4 5.14.
pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(0x88, lba, blocks)
}

/// WRITE(16), SBC-4 5.41.
pub fn write16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(0x8a, lba, blocks)
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// Length of the READ CAPACITY(16) parameter data this initiator asks for.
pub const READ_CAPACITY16_LEN: usize = 32;

/// READ CAPACITY(16) (SERVICE ACTION IN(16), SBC-4 5.20).
pub fn read_capacity16() -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x9e;
    c[1] = 0x10;
    c[10..14].copy_from_slice(&(READ_CAPACITY16_LEN as u32).to_be_bytes());
    c
}

/// A logical unit's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Logical blocks.
    pub blocks: u64,
    /// Bytes per logical block.
    pub block_size: u32,
}

impl Capacity {
    /// Decodes READ CAPACITY(16) parameter data (SBC-4 Table 125).
    pub fn parse16(data: &[u8]) -> Option<Capacity> {
        let last = u64::from_be_bytes(data.get(0..8)?.try_into().ok()?);
        let block_size = u32::from_be_bytes(data.get(8..12)?.try_into().ok()?);
        if block_size == 0 || !block_size.is_power_of_two() {
            return None;
        }
        Some(Capacity {
            blocks: last.checked_add(1)?,
            block_size,
        })
    }

    /// Capacity in bytes.
    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(u64::from(self.block_size))
    }
}

/// Decoded sense data: the sense key and the additional sense code and qualifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    /// Sense key.
    pub key: u8,
    /// Additional sense code.
    pub asc: u8,
    /// Additional sense code qualifier.
    pub ascq: u8,
}

/// Sense key UNIT ATTENTION.
pub const SENSE_UNIT_ATTENTION: u8 = 0x6;
/// Sense key ILLEGAL REQUEST.
pub const SENSE_ILLEGAL_REQUEST: u8 = 0x5;

impl Sense {
    /// Decodes fixed (0x70/0x71) or descriptor (0x72/0x73) format sense data (SPC-5 4.4).
    pub fn parse(s: &[u8]) -> Option<Sense> {
        match s.first()? & 0x7f {
            0x70 | 0x71 => Some(Sense {
                key: s.get(2)? & 0x0f,
                asc: *s.get(12).unwrap_or(&0),
                ascq: *s.get(13).unwrap_or(&0),
            }),
            0x72 | 0x73 => Some(Sense {
                key: s.get(1)? & 0x0f,
                asc: *s.get(2).unwrap_or(&0),
                ascq: *s.get(3).unwrap_or(&0),
            }),
            _ => None,
        }
    }

    /// Sense data as an iSCSI SCSI Response carries it: a 2-byte SenseLength, then the data.
    pub fn from_segment(seg: &[u8]) -> Option<Sense> {
        let len = usize::from(u16::from_be_bytes([*seg.first()?, *seg.get(1)?]));
        Self::parse(seg.get(2..2 + len.min(seg.len() - 2))?)
    }

    fn key_name(&self) -> &'static str {
        match self.key {
            0x0 => "NO SENSE",
            0x1 => "RECOVERED ERROR",
            0x2 => "NOT READY",
            0x3 => "MEDIUM ERROR",
            0x4 => "HARDWARE ERROR",
            0x5 => "ILLEGAL REQUEST",
            0x6 => "UNIT ATTENTION",
            0x7 => "DATA PROTECT",
            0xb => "ABORTED COMMAND",
            _ => "sense key",
        }
    }

    fn asc_text(&self) -> Option<&'static str> {
        Some(match (self.asc, self.ascq) {
            (0x04, _) => "logical unit not ready",
            (0x20, 0x00) => "invalid command operation code",
            (0x21, 0x00) => "logical block address out of range",
            (0x24, 0x00) => "invalid field in CDB",
            (0x25, 0x00) => "logical unit not supported (no such LUN)",
            (0x27, _) => "write protected",
            (0x29, _) => "power on, reset or bus device reset occurred",
            (0x2a, _) => "parameters changed",
            (0x3f, _) => "target operating conditions have changed",
            _ => return None,
        })
    }

    /// Whether the logical unit does not exist.
    pub fn no_such_lun(&self) -> bool {
        self.key == SENSE_ILLEGAL_REQUEST && self.asc == 0x25
    }
}

impl fmt::Display for Sense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (key {:#x}), ASC/ASCQ {:#04x}/{:#04x}",
            self.key_name(),
            self.key,
            self.asc,
            self.ascq
        )?;
        if let Some(t) = self.asc_text() {
            write!(f, ": {t}")?;
        }
        Ok(())
    }
}

/// A SCSI status byte in words (SAM-5 5.3).
pub fn status_name(status: u8) -> &'static str {
    match status {
        0x00 => "GOOD",
        0x02 => "CHECK CONDITION",
        0x04 => "CONDITION MET",
        0x08 => "BUSY",
        0x18 => "RESERVATION CONFLICT",
        0x28 => "TASK SET FULL",
        0x30 => "ACA ACTIVE",
        0x40 => "TASK ABORTED",
        _ => "unknown status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdbs() {
        let r = read16(0x0102_0304_0506_0708, 8);
        assert_eq!(r[0], 0x88);
        assert_eq!(&r[2..10], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&r[10..14], &[0, 0, 0, 8]);
        assert_eq!(write16(0, 1)[0], 0x8a);
        let c = read_capacity16();
        assert_eq!((c[0], c[1], c[13]), (0x9e, 0x10, 32));
    }

    #[test]
    fn capacity_decodes_and_refuses_nonsense() {
        let mut d = [0u8; 32];
        d[0..8].copy_from_slice(&1023u64.to_be_bytes());
        d[8..12].copy_from_slice(&4096u32.to_be_bytes());
        let c = Capacity::parse16(&d).unwrap();
        assert_eq!((c.blocks, c.block_size, c.bytes()), (1024, 4096, 4 << 20));
        assert_eq!(Capacity::parse16(&d[..10]), None);
        d[8..12].copy_from_slice(&0u32.to_be_bytes());
        assert_eq!(Capacity::parse16(&d), None);
        d[8..12].copy_from_slice(&1000u32.to_be_bytes());
        assert_eq!(Capacity::parse16(&d), None);
        d[0..8].copy_from_slice(&u64::MAX.to_be_bytes());
        d[8..12].copy_from_slice(&512u32.to_be_bytes());
        assert_eq!(Capacity::parse16(&d), None);
    }

    #[test]
    fn sense_formats() {
        let mut fixed = [0u8; 18];
        fixed[0] = 0x70;
        fixed[2] = 0x05;
        fixed[12] = 0x25;
        let mut seg = vec![0, 18];
        seg.extend_from_slice(&fixed);
        let s = Sense::from_segment(&seg).unwrap();
        assert!(s.no_such_lun());
        assert!(s.to_string().contains("no such LUN"), "{s}");
        let desc = [0x72, 0x06, 0x29, 0x00];
        let s = Sense::parse(&desc).unwrap();
        assert_eq!(s.key, SENSE_UNIT_ATTENTION);
        assert!(s.to_string().starts_with("UNIT ATTENTION"));
        // Truncated or foreign data.
        assert_eq!(Sense::from_segment(&[]), None);
        assert_eq!(Sense::from_segment(&[0]), None);
        assert_eq!(Sense::from_segment(&[0, 0]), None);
        assert_eq!(Sense::from_segment(&[0, 200, 0x70]), None);
        assert_eq!(Sense::parse(&[0x00, 1, 2]), None);
        assert_eq!(Sense::parse(&[0x72]), None);
        assert_eq!(status_name(0x28), "TASK SET FULL");
    }
}
