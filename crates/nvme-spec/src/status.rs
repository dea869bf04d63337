//! Completion status codes with their names (NVMe Base Specification 2.0, section 4.6.1.2,
//! and NVMe over Fabrics 1.1, Figure 24 for the fabrics command specific codes).

use std::fmt;

/// Status code types (SCT).
pub mod sct {
    /// Generic command status.
    pub const GENERIC: u8 = 0x0;
    /// Command specific status.
    pub const COMMAND_SPECIFIC: u8 = 0x1;
    /// Media and data integrity errors.
    pub const MEDIA: u8 = 0x2;
    /// Path related status.
    pub const PATH: u8 = 0x3;
    /// Vendor specific.
    pub const VENDOR: u8 = 0x7;
}

/// Generic command status codes (SCT 0).
pub mod generic {
    /// Successful completion.
    pub const SUCCESS: u8 = 0x00;
    /// Invalid command opcode.
    pub const INVALID_OPCODE: u8 = 0x01;
    /// Invalid field in command.
    pub const INVALID_FIELD: u8 = 0x02;
    /// Command ID conflict.
    pub const COMMAND_ID_CONFLICT: u8 = 0x03;
    /// Data transfer error.
    pub const DATA_TRANSFER_ERROR: u8 = 0x04;
    /// Commands aborted due to power loss notification.
    pub const ABORTED_POWER_LOSS: u8 = 0x05;
    /// Internal error.
    pub const INTERNAL_ERROR: u8 = 0x06;
    /// Command abort requested.
    pub const ABORT_REQUESTED: u8 = 0x07;
    /// Command aborted due to SQ deletion.
    pub const ABORTED_SQ_DELETION: u8 = 0x08;
    /// Invalid namespace or format.
    pub const INVALID_NAMESPACE: u8 = 0x0B;
    /// Command sequence error.
    pub const COMMAND_SEQUENCE_ERROR: u8 = 0x0C;
    /// Invalid SGL segment descriptor.
    pub const INVALID_SGL_SEGMENT: u8 = 0x0D;
    /// Invalid number of SGL descriptors.
    pub const INVALID_SGL_COUNT: u8 = 0x0E;
    /// Data SGL length invalid.
    pub const DATA_SGL_LENGTH_INVALID: u8 = 0x0F;
    /// SGL descriptor type invalid.
    pub const SGL_TYPE_INVALID: u8 = 0x11;
    /// Operation denied.
    pub const OPERATION_DENIED: u8 = 0x15;
    /// SGL offset invalid.
    pub const SGL_OFFSET_INVALID: u8 = 0x16;
    /// Host identifier inconsistent format.
    pub const HOST_ID_INCONSISTENT: u8 = 0x18;
    /// Keep alive timer expired.
    pub const KEEP_ALIVE_EXPIRED: u8 = 0x19;
    /// Keep alive timeout invalid.
    pub const KEEP_ALIVE_INVALID: u8 = 0x1A;
    /// Namespace is write protected.
    pub const NAMESPACE_WRITE_PROTECTED: u8 = 0x20;
    /// Command interrupted.
    pub const COMMAND_INTERRUPTED: u8 = 0x21;
    /// Transient transport error.
    pub const TRANSIENT_TRANSPORT_ERROR: u8 = 0x22;
    /// LBA out of range.
    pub const LBA_OUT_OF_RANGE: u8 = 0x80;
    /// Capacity exceeded.
    pub const CAPACITY_EXCEEDED: u8 = 0x81;
    /// Namespace not ready.
    pub const NAMESPACE_NOT_READY: u8 = 0x82;
    /// Reservation conflict.
    pub const RESERVATION_CONFLICT: u8 = 0x83;
}

/// Command specific status codes (SCT 1).
pub mod specific {
    /// Completion queue invalid.
    pub const CQ_INVALID: u8 = 0x00;
    /// Invalid queue identifier.
    pub const INVALID_QUEUE_ID: u8 = 0x01;
    /// Invalid queue size.
    pub const INVALID_QUEUE_SIZE: u8 = 0x02;
    /// Abort command limit exceeded.
    pub const ABORT_LIMIT_EXCEEDED: u8 = 0x03;
    /// Asynchronous event request limit exceeded.
    pub const AER_LIMIT_EXCEEDED: u8 = 0x05;
    /// Invalid log page.
    pub const INVALID_LOG_PAGE: u8 = 0x09;
    /// Feature identifier not saveable.
    pub const FEATURE_NOT_SAVEABLE: u8 = 0x0D;
    /// Feature not changeable.
    pub const FEATURE_NOT_CHANGEABLE: u8 = 0x0E;
    /// Conflicting attributes (Dataset Management, Read, Write).
    pub const CONFLICTING_ATTRIBUTES: u8 = 0x80;
    /// Fabrics Connect: incompatible format.
    pub const CONNECT_INCOMPATIBLE_FORMAT: u8 = 0x80;
    /// Fabrics Connect: controller busy.
    pub const CONNECT_CONTROLLER_BUSY: u8 = 0x81;
    /// Fabrics Connect: invalid parameters.
    pub const CONNECT_INVALID_PARAMETERS: u8 = 0x82;
    /// Fabrics Connect: restart discovery.
    pub const CONNECT_RESTART_DISCOVERY: u8 = 0x83;
    /// Fabrics Connect: invalid host.
    pub const CONNECT_INVALID_HOST: u8 = 0x84;
    /// Authentication required: the queue has not completed the authentication its
    /// controller requires (status 0x191 as Linux writes SCT and SC together).
    pub const AUTH_REQUIRED: u8 = 0x91;
}

/// Media and data integrity errors (SCT 2).
pub mod media {
    /// Write fault.
    pub const WRITE_FAULT: u8 = 0x80;
    /// Unrecovered read error.
    pub const UNRECOVERED_READ_ERROR: u8 = 0x81;
    /// Access denied.
    pub const ACCESS_DENIED: u8 = 0x86;
}

/// Path related status (SCT 3).
pub mod path {
    /// Internal path error.
    pub const INTERNAL_PATH_ERROR: u8 = 0x00;
    /// Asymmetric Access Persistent Loss: the namespace is not reachable through this
    /// controller, and will not be again.
    pub const ANA_PERSISTENT_LOSS: u8 = 0x01;
    /// Asymmetric Access Inaccessible: the namespace is not reachable through this
    /// controller now.
    pub const ANA_INACCESSIBLE: u8 = 0x02;
    /// Asymmetric Access Transition: the namespace's group is changing state.
    pub const ANA_TRANSITION: u8 = 0x03;
    /// Command aborted by host (the host gave up on the command).
    pub const ABORTED_BY_HOST: u8 = 0x71;
}

/// A completion status: type, code and the Do Not Retry / More bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status {
    /// Status code type.
    pub sct: u8,
    /// Status code.
    pub sc: u8,
    /// Do not retry.
    pub dnr: bool,
    /// More information in the error log.
    pub more: bool,
}

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = Status {
        sct: 0,
        sc: 0,
        dnr: false,
        more: false,
    };

    /// A generic status (SCT 0).
    pub const fn generic(sc: u8) -> Self {
        Status {
            sct: sct::GENERIC,
            sc,
            dnr: false,
            more: false,
        }
    }

    /// A command specific status (SCT 1).
    pub const fn specific(sc: u8) -> Self {
        Status {
            sct: sct::COMMAND_SPECIFIC,
            sc,
            dnr: false,
            more: false,
        }
    }

    /// A media error status (SCT 2).
    pub const fn media(sc: u8) -> Self {
        Status {
            sct: sct::MEDIA,
            sc,
            dnr: false,
            more: false,
        }
    }

    /// The same status with Do Not Retry set.
    pub const fn with_dnr(mut self) -> Self {
        self.dnr = true;
        self
    }

    /// True for a successful completion.
    pub const fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// Encodes the 15-bit status field (CQE DW3 bits 31:17, without the phase tag).
    pub const fn to_field(&self) -> u16 {
        (self.sc as u16)
            | (((self.sct & 0x7) as u16) << 8)
            | ((self.more as u16) << 13)
            | ((self.dnr as u16) << 14)
    }

    /// Decodes the 15-bit status field (phase tag already stripped).
    pub const fn from_field(field: u16) -> Self {
        Status {
            sc: (field & 0xFF) as u8,
            sct: ((field >> 8) & 0x7) as u8,
            more: (field >> 13) & 1 == 1,
            dnr: (field >> 14) & 1 == 1,
        }
    }

    /// The specification's name for this status, or a generic description.
    pub fn name(&self) -> &'static str {
        match (self.sct, self.sc) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x03) => "Command ID Conflict",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x05) => "Commands Aborted due to Power Loss Notification",
            (0, 0x06) => "Internal Error",
            (0, 0x07) => "Command Abort Requested",
            (0, 0x08) => "Command Aborted due to SQ Deletion",
            (0, 0x0B) => "Invalid Namespace or Format",
            (0, 0x0C) => "Command Sequence Error",
            (0, 0x0D) => "Invalid SGL Segment Descriptor",
            (0, 0x0E) => "Invalid Number of SGL Descriptors",
            (0, 0x0F) => "Data SGL Length Invalid",
            (0, 0x11) => "SGL Descriptor Type Invalid",
            (0, 0x15) => "Operation Denied",
            (0, 0x16) => "SGL Offset Invalid",
            (0, 0x18) => "Host Identifier Inconsistent Format",
            (0, 0x19) => "Keep Alive Timer Expired",
            (0, 0x1A) => "Keep Alive Timeout Invalid",
            (0, 0x20) => "Namespace is Write Protected",
            (0, 0x21) => "Command Interrupted",
            (0, 0x22) => "Transient Transport Error",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (0, 0x83) => "Reservation Conflict",
            (1, 0x00) => "Completion Queue Invalid",
            (1, 0x01) => "Invalid Queue Identifier",
            (1, 0x02) => "Invalid Queue Size",
            (1, 0x03) => "Abort Command Limit Exceeded",
            (1, 0x05) => "Asynchronous Event Request Limit Exceeded",
            (1, 0x09) => "Invalid Log Page",
            (1, 0x0D) => "Feature Identifier Not Saveable",
            (1, 0x0E) => "Feature Not Changeable",
            (1, 0x80) => "Connect Incompatible Format / Conflicting Attributes",
            (1, 0x81) => "Connect Controller Busy",
            (1, 0x82) => "Connect Invalid Parameters",
            (1, 0x83) => "Connect Restart Discovery",
            (1, 0x84) => "Connect Invalid Host",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            (2, 0x86) => "Access Denied",
            (3, 0x00) => "Internal Path Error",
            (3, 0x01) => "Asymmetric Access Persistent Loss",
            (3, 0x02) => "Asymmetric Access Inaccessible",
            (3, 0x03) => "Asymmetric Access Transition",
            (3, 0x71) => "Command Aborted By Host",
            (0, _) => "Generic Command Status",
            (1, _) => "Command Specific Status",
            (2, _) => "Media and Data Integrity Error",
            (3, _) => "Path Related Status",
            (7, _) => "Vendor Specific Status",
            _ => "Reserved Status Code Type",
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (sct {:#x}, sc {:#04x}{})",
            self.name(),
            self.sct,
            self.sc,
            if self.dnr { ", dnr" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_round_trip_all() {
        for field in 0u16..0x8000 {
            let s = Status::from_field(field);
            // Bits 11:9 of the field beyond SCT (CRD) are not kept; mask them.
            assert_eq!(s.to_field(), field & !(0b11 << 11));
        }
    }

    #[test]
    fn names() {
        assert_eq!(
            Status::generic(generic::LBA_OUT_OF_RANGE).name(),
            "LBA Out of Range"
        );
        assert_eq!(
            Status::specific(specific::CONNECT_INVALID_HOST).to_string(),
            "Connect Invalid Host (sct 0x1, sc 0x84)"
        );
    }
}
