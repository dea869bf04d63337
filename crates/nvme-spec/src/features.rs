//! Feature identifiers for Set/Get Features (NVMe Base 2.0, Figure 385).

/// Arbitration.
pub const ARBITRATION: u8 = 0x01;
/// Power Management.
pub const POWER_MANAGEMENT: u8 = 0x02;
/// Temperature Threshold.
pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
/// Volatile Write Cache.
pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
/// Number of Queues: CDW11/DW0 bits 15:0 submission queues, 31:16 completion queues (0's based).
pub const NUMBER_OF_QUEUES: u8 = 0x07;
/// Interrupt Coalescing.
pub const INTERRUPT_COALESCING: u8 = 0x08;
/// Asynchronous Event Configuration.
pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
/// Keep Alive Timer (CDW11 = KATO in milliseconds).
pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
/// Reservation Notification Mask (namespace specific).
pub const RESERVATION_NOTIFICATION_MASK: u8 = 0x82;
/// Reservation Persistence (namespace specific).
pub const RESERVATION_PERSISTENCE: u8 = 0x83;

/// Asynchronous Event Configuration bit: Namespace Attribute Notices.
pub const AEC_NS_ATTRIBUTE_NOTICES: u32 = 1 << 8;
/// Asynchronous Event Configuration bit: Asymmetric Namespace Access Change Notices.
pub const AEC_ANA_CHANGE: u32 = 1 << 11;
/// Asynchronous Event Configuration bit: Discovery Log Page Change Notices.
pub const AEC_DISCOVERY_LOG_CHANGE: u32 = 1 << 31;

/// Asynchronous event types (completion DW0 bits 2:0).
pub mod aer_type {
    /// Error status.
    pub const ERROR: u8 = 0;
    /// SMART / health status.
    pub const SMART: u8 = 1;
    /// Notice.
    pub const NOTICE: u8 = 2;
}

/// Event type of completion DW0 bits 2:0: I/O command specific status.
pub const AER_TYPE_IO_COMMAND_SPECIFIC: u8 = 6;
/// I/O command specific event information: a Reservation Notification log page is available.
pub const AER_RESERVATION_LOG_AVAILABLE: u8 = 0;

/// Notice event information values (completion DW0 bits 15:8 with type NOTICE).
pub mod aer_notice {
    /// Namespace attribute changed (log page 0x04).
    pub const NS_ATTRIBUTE_CHANGED: u8 = 0x00;
    /// Asymmetric namespace access change (log page 0x0C).
    pub const ANA_CHANGE: u8 = 0x03;
    /// Discovery log page change (log page 0x70).
    pub const DISCOVERY_LOG_CHANGE: u8 = 0xF0;
}

/// Builds an Asynchronous Event Request completion DW0.
pub const fn aer_dw0(event_type: u8, info: u8, log_page: u8) -> u32 {
    (event_type as u32 & 0x7) | ((info as u32) << 8) | ((log_page as u32) << 16)
}
