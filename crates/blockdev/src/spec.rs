//! Backend specifications: the strings and TOML tables that name a backend.
//!
//! String form, as used on command lines and in configs:
//!
//! | spec | meaning |
//! |---|---|
//! | `mem:1G` | sparse memory namespace of 1 GiB, 4096-byte blocks |
//! | `mem:1T,bs=512` | the same with 512-byte blocks |
//! | `null:512M` | null backend (reads zeros, discards writes) |
//! | `file:/path` | existing file; its length is the capacity |
//! | `file:/path,size=10G` | the file, created with 10 GiB if missing or empty; an existing file must be 10 GiB |
//! | `bdev:/dev/nvme0n1` | block device; size and block size from the device |
//! | `file:/path,volatile_cache=64M` | the file behind a 64 MiB volatile write cache (testing) |
//! | `pcie:0000:01:00.0` | the first active namespace of the NVMe controller at that PCI address, bound to `vfio-pci` ([`PcieBackend`](crate::PcieBackend)) |
//! | `pcie:0000:01:00.0,nsid=2` | its namespace 2 |
//!
//! Sizes are bytes with an optional `K`, `M`, `G`, `T` or `P` suffix (powers of 1024; `KiB`,
//! `KB` and lowercase are accepted too). File and block device specs also take
//! `bs=N` (files only), `direct=on|off` (default on: `O_DIRECT`) and
//! `engine=auto|uring|blocking` (default auto), `shared=on|off` (default off: the file or
//! device is claimed with an exclusive `flock`; on: not claimed, for two target processes
//! serving it at once as an ANA pair) and `volatile_cache=SIZE`: a testing feature
//! that keeps up to SIZE bytes of written blocks in process memory until a Flush or a Force Unit
//! Access write (see [`VolatileCache`](crate::VolatileCache)), so killing the process loses
//! them as a power cut would. A path ends at the first comma.
//!
//! In TOML a backend is either such a string or a table with a `kind` key:
//!
//! ```toml
//! backend = "file:/var/lib/ns1.img,size=100G"
//! # or
//! [backend]
//! kind = "mem"          # mem | null | file | bdev | pcie
//! # pcie: address = "0000:01:00.0", nsid = 1 (optional)
//! size = "1T"           # or a number of bytes
//! block_size = 512
//! ```

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The block size used when a memory, null or file spec names none.
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;

/// How a file backend submits its I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoEngine {
    /// io_uring when the kernel allows it, else the blocking pool.
    #[default]
    Auto,
    /// io_uring only; opening fails if io_uring is unavailable.
    Uring,
    /// Positional reads and writes on tokio's blocking thread pool.
    Blocking,
}

impl IoEngine {
    fn as_str(self) -> &'static str {
        match self {
            IoEngine::Auto => "auto",
            IoEngine::Uring => "uring",
            IoEngine::Blocking => "blocking",
        }
    }
}

impl FromStr for IoEngine {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "auto" => Ok(IoEngine::Auto),
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            "blocking" | "threads" => Ok(IoEngine::Blocking),
            _ => Err(SpecError::BadValue {
                key: "engine".into(),
                value: s.into(),
            }),
        }
    }
}

/// A file or block device backend's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// Path of the file or device node.
    pub path: PathBuf,
    /// Create the file with this many bytes if it is missing or empty (files only); an
    /// existing file of another length is refused.
    pub create_size: Option<u64>,
    /// Block size in bytes (files only; devices report their own). `None`: [`DEFAULT_BLOCK_SIZE`].
    pub block_size: Option<u32>,
    /// Open with `O_DIRECT` (falling back to buffered I/O where the file system refuses it).
    pub direct: bool,
    /// How I/O is submitted.
    pub engine: IoEngine,
    /// Claim the file or device for this backend alone (an exclusive `flock` while open, and
    /// the target refuses it for a second namespace). The spec option `shared=on` turns it
    /// off, for a file or device that two target processes serve at once (an ANA
    /// active/standby or active/active pair exporting one namespace); programs that
    /// deliberately open one file several times, such as a benchmark comparing access paths,
    /// turn it off too.
    pub exclusive: bool,
    /// Bytes of volatile write cache in front of it (a testing feature; `None`: no cache).
    pub volatile_cache: Option<u64>,
}

impl FileSpec {
    /// A spec for `path` with every other setting at its default.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileSpec {
            path: path.into(),
            create_size: None,
            block_size: None,
            direct: true,
            engine: IoEngine::Auto,
            exclusive: true,
            volatile_cache: None,
        }
    }
}

/// Which backend to open, and how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SpecRepr", into = "String")]
pub enum BackendSpec {
    /// Sparse memory.
    Memory {
        /// Capacity in bytes.
        size: u64,
        /// Block size in bytes.
        block_size: u32,
    },
    /// Reads return zeros, writes are discarded.
    Null {
        /// Capacity in bytes.
        size: u64,
        /// Block size in bytes.
        block_size: u32,
    },
    /// A regular file (a block device named here is accepted too).
    File(FileSpec),
    /// A block device; size and block size come from the device.
    Bdev(FileSpec),
    /// A namespace of an NVMe controller bound to `vfio-pci`, driven from user space.
    Pcie {
        /// PCI address `DOMAIN:BUS:DEV.FN` (lowercase hex, e.g. `0000:01:00.0`).
        address: String,
        /// Namespace ID (`None`: the first active namespace).
        nsid: Option<u32>,
    },
}

/// An error in a backend spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The spec has no `kind:` prefix or names an unknown kind.
    #[error("unknown backend kind in {0:?} (expected mem:, null:, file:, bdev: or pcie:)")]
    UnknownKind(String),
    /// A size could not be parsed.
    #[error("invalid size {0:?} (expected bytes with an optional K/M/G/T/P suffix)")]
    BadSize(String),
    /// An option is not known for this kind.
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    /// An option's value is invalid.
    #[error("invalid value {value:?} for {key}")]
    BadValue {
        /// The option.
        key: String,
        /// The value given.
        value: String,
    },
    /// A required part is missing.
    #[error("missing {0}")]
    Missing(&'static str),
    /// Sizes and block size do not fit together.
    #[error("{0}")]
    Geometry(String),
    /// A block size that is not one of 512, 1K, 2K ... 64K.
    #[error(
        "invalid block size {0:?}: use 512, 1K, 2K, 4K, 8K, 16K, 32K or 64K (a power of two \
         from 512 bytes to 64 KiB)"
    )]
    BadBlockSize(String),
}

/// Parses a size such as `4096`, `64K`, `1G`, `10GiB` or `2t` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, SpecError> {
    let bad = || SpecError::BadSize(s.to_string());
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// Formats a byte count with the largest suffix that divides it exactly.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")];
    for (shift, unit) in UNITS {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Checks that a block size is a power of two from 512 to 64 KiB.
pub fn validate_block_size(block_size: u32) -> Result<(), SpecError> {
    if block_size.is_power_of_two() && (512..=65536).contains(&block_size) {
        Ok(())
    } else {
        Err(SpecError::BadBlockSize(block_size.to_string()))
    }
}

fn validate_geometry(size: u64, block_size: u32) -> Result<(), SpecError> {
    validate_block_size(block_size)?;
    if size == 0 || size % u64::from(block_size) != 0 {
        return Err(SpecError::Geometry(format!(
            "size {size} is not a non-zero multiple of the block size {block_size}"
        )));
    }
    Ok(())
}

fn parse_block_size(v: &str) -> Result<u32, SpecError> {
    let bad = || SpecError::BadBlockSize(v.into());
    let bs = u32::try_from(parse_size(v).map_err(|_| bad())?).map_err(|_| bad())?;
    validate_block_size(bs).map_err(|_| bad())?;
    Ok(bs)
}

fn parse_bool(key: &str, v: &str) -> Result<bool, SpecError> {
    match v {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(SpecError::BadValue {
            key: key.into(),
            value: v.into(),
        }),
    }
}

/// A volatile cache must hold at least one block (of 512 bytes, the smallest block size;
/// opening checks it against the real one).
fn validate_cache(f: &FileSpec) -> Result<(), SpecError> {
    match f.volatile_cache {
        Some(size) if size < 512 => Err(SpecError::BadValue {
            key: "volatile_cache".into(),
            value: size.to_string(),
        }),
        _ => Ok(()),
    }
}

/// Checks a PCI address `DOMAIN:BUS:DEV.FN` (4, 2, 2 and 1 hex digits; device below 0x20,
/// function below 8) and returns it in lowercase.
fn parse_pci_address(a: &str) -> Result<String, SpecError> {
    let bad = || SpecError::BadValue {
        key: "PCI address (DOMAIN:BUS:DEV.FN, e.g. 0000:01:00.0)".into(),
        value: a.into(),
    };
    let hex = |s: &str, digits: usize| {
        (s.len() == digits && s.chars().all(|c| c.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let mut parts = a.split(':');
    let (Some(domain), Some(bus), Some(devfn), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let (dev, func) = devfn.split_once('.').ok_or_else(bad)?;
    match (hex(domain, 4), hex(bus, 2), hex(dev, 2), hex(func, 1)) {
        (Some(_), Some(_), Some(d), Some(f)) if d < 0x20 && f < 8 => Ok(a.to_ascii_lowercase()),
        _ => Err(bad()),
    }
}

fn check_nsid(nsid: Option<u32>) -> Result<(), SpecError> {
    match nsid {
        Some(n @ (0 | u32::MAX)) => Err(SpecError::BadValue {
            key: "nsid".into(),
            value: n.to_string(),
        }),
        _ => Ok(()),
    }
}

impl BackendSpec {
    /// The same backend, opened without claiming its file or device (see
    /// [`FileSpec::exclusive`]).
    pub fn shared(&self) -> BackendSpec {
        let mut spec = self.clone();
        if let BackendSpec::File(f) | BackendSpec::Bdev(f) = &mut spec {
            f.exclusive = false;
        }
        spec
    }

    /// Validates sizes and options that parsing alone does not check.
    pub fn validate(&self) -> Result<(), SpecError> {
        match self {
            BackendSpec::Memory { size, block_size } | BackendSpec::Null { size, block_size } => {
                validate_geometry(*size, *block_size)
            }
            BackendSpec::File(f) => {
                if f.path.as_os_str().is_empty() {
                    return Err(SpecError::Missing("path"));
                }
                validate_cache(f)?;
                let bs = f.block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
                match f.create_size {
                    Some(size) => validate_geometry(size, bs),
                    None => validate_block_size(bs),
                }
            }
            BackendSpec::Bdev(f) => {
                if f.path.as_os_str().is_empty() {
                    return Err(SpecError::Missing("path"));
                }
                validate_cache(f)?;
                if f.create_size.is_some() {
                    return Err(SpecError::UnknownOption("size".into()));
                }
                if f.block_size.is_some() {
                    return Err(SpecError::UnknownOption("bs".into()));
                }
                Ok(())
            }
            BackendSpec::Pcie { address, nsid } => {
                if parse_pci_address(address)? != *address {
                    return Err(SpecError::BadValue {
                        key: "PCI address (lowercase hex)".into(),
                        value: address.clone(),
                    });
                }
                check_nsid(*nsid)
            }
        }
    }
}

impl FromStr for BackendSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let (kind, rest) = s
            .split_once(':')
            .ok_or_else(|| SpecError::UnknownKind(s.to_string()))?;
        let mut parts = rest.split(',');
        let first = parts.next().unwrap_or("");
        let options = parts.map(|opt| {
            opt.split_once('=')
                .ok_or_else(|| SpecError::UnknownOption(opt.to_string()))
        });
        let spec = match kind {
            "mem" | "memory" | "null" => {
                if first.is_empty() {
                    return Err(SpecError::Missing("size"));
                }
                let size = parse_size(first)?;
                let mut block_size = DEFAULT_BLOCK_SIZE;
                for opt in options {
                    match opt? {
                        ("bs" | "block_size", v) => block_size = parse_block_size(v)?,
                        (k, _) => return Err(SpecError::UnknownOption(k.to_string())),
                    }
                }
                if kind == "null" {
                    BackendSpec::Null { size, block_size }
                } else {
                    BackendSpec::Memory { size, block_size }
                }
            }
            "file" | "bdev" => {
                if first.is_empty() {
                    return Err(SpecError::Missing("path"));
                }
                let mut f = FileSpec::new(first);
                for opt in options {
                    match opt? {
                        ("size", v) if kind == "file" => f.create_size = Some(parse_size(v)?),
                        ("bs" | "block_size", v) if kind == "file" => {
                            f.block_size = Some(parse_block_size(v)?)
                        }
                        ("direct", v) => f.direct = parse_bool("direct", v)?,
                        ("engine", v) => f.engine = v.parse()?,
                        ("volatile_cache", v) => f.volatile_cache = Some(parse_size(v)?),
                        ("shared", v) => f.exclusive = !parse_bool("shared", v)?,
                        (k, _) => return Err(SpecError::UnknownOption(k.to_string())),
                    }
                }
                if kind == "file" {
                    BackendSpec::File(f)
                } else {
                    BackendSpec::Bdev(f)
                }
            }
            "pcie" => {
                if first.is_empty() {
                    return Err(SpecError::Missing("PCI address"));
                }
                let address = parse_pci_address(first)?;
                let mut nsid = None;
                for opt in options {
                    match opt? {
                        ("nsid", v) => {
                            nsid = Some(v.parse().map_err(|_| SpecError::BadValue {
                                key: "nsid".into(),
                                value: v.into(),
                            })?)
                        }
                        (k, _) => return Err(SpecError::UnknownOption(k.to_string())),
                    }
                }
                BackendSpec::Pcie { address, nsid }
            }
            _ => return Err(SpecError::UnknownKind(s.to_string())),
        };
        spec.validate()?;
        Ok(spec)
    }
}

impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn file_opts(f: &mut fmt::Formatter<'_>, spec: &FileSpec) -> fmt::Result {
            if let Some(size) = spec.create_size {
                write!(f, ",size={}", format_size(size))?;
            }
            if let Some(bs) = spec.block_size {
                write!(f, ",bs={bs}")?;
            }
            if !spec.direct {
                f.write_str(",direct=off")?;
            }
            if spec.engine != IoEngine::Auto {
                write!(f, ",engine={}", spec.engine.as_str())?;
            }
            if let Some(size) = spec.volatile_cache {
                write!(f, ",volatile_cache={}", format_size(size))?;
            }
            if !spec.exclusive {
                f.write_str(",shared=on")?;
            }
            Ok(())
        }
        match self {
            BackendSpec::Memory { size, block_size } => {
                write!(f, "mem:{},bs={block_size}", format_size(*size))
            }
            BackendSpec::Null { size, block_size } => {
                write!(f, "null:{},bs={block_size}", format_size(*size))
            }
            BackendSpec::File(spec) => {
                write!(f, "file:{}", spec.path.display())?;
                file_opts(f, spec)
            }
            BackendSpec::Bdev(spec) => {
                write!(f, "bdev:{}", spec.path.display())?;
                file_opts(f, spec)
            }
            BackendSpec::Pcie { address, nsid } => {
                write!(f, "pcie:{address}")?;
                match nsid {
                    Some(n) => write!(f, ",nsid={n}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl From<BackendSpec> for String {
    fn from(spec: BackendSpec) -> String {
        spec.to_string()
    }
}

/// A size in a config: a number of bytes or a string with a suffix.
#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Bytes(u64),
    Text(String),
}

impl SizeRepr {
    fn bytes(&self) -> Result<u64, SpecError> {
        match self {
            SizeRepr::Bytes(n) => Ok(*n),
            SizeRepr::Text(s) => parse_size(s),
        }
    }
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum TableSpec {
    #[serde(alias = "memory")]
    Mem {
        size: SizeRepr,
        block_size: Option<u32>,
    },
    Null {
        size: SizeRepr,
        block_size: Option<u32>,
    },
    File {
        path: PathBuf,
        #[serde(alias = "create_size")]
        size: Option<SizeRepr>,
        block_size: Option<u32>,
        direct: Option<bool>,
        engine: Option<IoEngine>,
        volatile_cache: Option<SizeRepr>,
        shared: Option<bool>,
    },
    Bdev {
        path: PathBuf,
        direct: Option<bool>,
        engine: Option<IoEngine>,
        volatile_cache: Option<SizeRepr>,
        shared: Option<bool>,
    },
    Pcie {
        address: String,
        nsid: Option<u32>,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SpecRepr {
    Text(String),
    Table(TableSpec),
}

impl TryFrom<SpecRepr> for BackendSpec {
    type Error = SpecError;

    fn try_from(repr: SpecRepr) -> Result<Self, SpecError> {
        let spec = match repr {
            SpecRepr::Text(s) => return s.parse(),
            SpecRepr::Table(TableSpec::Mem { size, block_size }) => BackendSpec::Memory {
                size: size.bytes()?,
                block_size: block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
            },
            SpecRepr::Table(TableSpec::Null { size, block_size }) => BackendSpec::Null {
                size: size.bytes()?,
                block_size: block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
            },
            SpecRepr::Table(TableSpec::File {
                path,
                size,
                block_size,
                direct,
                engine,
                volatile_cache,
                shared,
            }) => BackendSpec::File(FileSpec {
                path,
                create_size: size.map(|s| s.bytes()).transpose()?,
                block_size,
                direct: direct.unwrap_or(true),
                engine: engine.unwrap_or_default(),
                exclusive: !shared.unwrap_or(false),
                volatile_cache: volatile_cache.map(|s| s.bytes()).transpose()?,
            }),
            SpecRepr::Table(TableSpec::Bdev {
                path,
                direct,
                engine,
                volatile_cache,
                shared,
            }) => BackendSpec::Bdev(FileSpec {
                exclusive: !shared.unwrap_or(false),
                direct: direct.unwrap_or(true),
                engine: engine.unwrap_or_default(),
                volatile_cache: volatile_cache.map(|s| s.bytes()).transpose()?,
                ..FileSpec::new(path)
            }),
            SpecRepr::Table(TableSpec::Pcie { address, nsid }) => BackendSpec::Pcie {
                address: parse_pci_address(&address)?,
                nsid,
            },
        };
        spec.validate()?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("10GiB").unwrap(), 10 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("2P").unwrap(), 2 << 50);
        for bad in [
            "",
            "G",
            "1X",
            "-1",
            "1.5G",
            "99999999999999999999",
            "16384P",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(format_size(1 << 40), "1T");
        assert_eq!(format_size(3 << 20), "3M");
        assert_eq!(format_size(1536), "1536");
        assert_eq!(format_size(0), "0");
    }

    #[test]
    fn parse_kinds() {
        assert_eq!(
            "mem:1G".parse::<BackendSpec>().unwrap(),
            BackendSpec::Memory {
                size: 1 << 30,
                block_size: 4096
            }
        );
        assert_eq!(
            "null:512M,bs=512".parse::<BackendSpec>().unwrap(),
            BackendSpec::Null {
                size: 512 << 20,
                block_size: 512
            }
        );
        assert_eq!(
            "file:/tmp/x.img".parse::<BackendSpec>().unwrap(),
            BackendSpec::File(FileSpec::new("/tmp/x.img"))
        );
        assert_eq!(
            "file:/tmp/x.img,size=10G,bs=512,direct=off,engine=blocking"
                .parse::<BackendSpec>()
                .unwrap(),
            BackendSpec::File(FileSpec {
                path: "/tmp/x.img".into(),
                create_size: Some(10 << 30),
                block_size: Some(512),
                direct: false,
                engine: IoEngine::Blocking,
                exclusive: true,
                volatile_cache: None,
            })
        );
        assert_eq!(
            "bdev:/dev/sdb,volatile_cache=64M"
                .parse::<BackendSpec>()
                .unwrap(),
            BackendSpec::Bdev(FileSpec {
                volatile_cache: Some(64 << 20),
                ..FileSpec::new("/dev/sdb")
            })
        );
        assert_eq!(
            "bdev:/dev/nvme0n1".parse::<BackendSpec>().unwrap(),
            BackendSpec::Bdev(FileSpec::new("/dev/nvme0n1"))
        );
    }

    #[test]
    fn parse_errors() {
        for bad in [
            "",
            "1G",
            "disk:/x",
            "mem:",
            "mem:0",
            "mem:1000",
            "mem:1G,bs=1000",
            "mem:1G,bs=256",
            "mem:1G,foo=1",
            "mem:1G,bs",
            "file:",
            "file:/x,size=1001",
            "file:/x,engine=magic",
            "file:/x,direct=maybe",
            "bdev:/dev/x,size=1G",
            "bdev:/dev/x,bs=512",
            "file:/x,volatile_cache=0",
            "file:/x,volatile_cache=lots",
            "mem:1G,volatile_cache=1M",
        ] {
            assert!(bad.parse::<BackendSpec>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_bad_block_size_lists_the_valid_ones() {
        for bad in [
            "mem:1G,bs=1000",
            "mem:1G,bs=256",
            "file:/x,bs=128K",
            "null:1G,bs=big",
        ] {
            let e = bad.parse::<BackendSpec>().unwrap_err().to_string();
            assert!(
                e.contains("use 512, 1K, 2K, 4K, 8K, 16K, 32K or 64K"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "mem:1T,bs=512",
            "null:512M,bs=4096",
            "file:/a/b.img",
            "file:/a/b.img,size=10G,bs=512,direct=off,engine=uring",
            "bdev:/dev/nvme0n1,engine=blocking",
            "file:/a/b.img,size=1G,volatile_cache=64M",
            "file:/a/b.img,shared=on",
            "bdev:/dev/sdb,shared=on",
        ] {
            let spec: BackendSpec = s.parse().unwrap();
            assert_eq!(spec.to_string(), s);
            assert_eq!(spec.to_string().parse::<BackendSpec>().unwrap(), spec);
        }
    }

    #[derive(Deserialize)]
    struct Config {
        backend: BackendSpec,
    }

    #[test]
    fn toml_forms() {
        let c: Config = toml::from_str(r#"backend = "mem:1G,bs=512""#).unwrap();
        assert_eq!(
            c.backend,
            BackendSpec::Memory {
                size: 1 << 30,
                block_size: 512
            }
        );
        let c: Config = toml::from_str(
            "[backend]\nkind = \"file\"\npath = \"/srv/a.img\"\nsize = \"2G\"\nengine = \"blocking\"\n",
        )
        .unwrap();
        assert_eq!(
            c.backend,
            BackendSpec::File(FileSpec {
                create_size: Some(2 << 30),
                engine: IoEngine::Blocking,
                ..FileSpec::new("/srv/a.img")
            })
        );
        let c: Config =
            toml::from_str("[backend]\nkind = \"null\"\nsize = 1048576\nblock_size = 512\n")
                .unwrap();
        assert_eq!(
            c.backend,
            BackendSpec::Null {
                size: 1 << 20,
                block_size: 512
            }
        );
        let c: Config =
            toml::from_str("[backend]\nkind = \"bdev\"\npath = \"/dev/sda\"\n").unwrap();
        assert_eq!(c.backend, BackendSpec::Bdev(FileSpec::new("/dev/sda")));
        let c: Config = toml::from_str(
            "[backend]\nkind = \"bdev\"\npath = \"/dev/sda\"\nvolatile_cache = \"8M\"\n",
        )
        .unwrap();
        assert_eq!(c.backend.to_string(), "bdev:/dev/sda,volatile_cache=8M");
        let c: Config =
            toml::from_str("[backend]\nkind = \"file\"\npath = \"/a\"\nvolatile_cache = 1048576\n")
                .unwrap();
        assert_eq!(c.backend.to_string(), "file:/a,volatile_cache=1M");
        let c: Config = toml::from_str(r#"backend = "file:/a,volatile_cache=64K""#).unwrap();
        assert_eq!(c.backend.to_string(), "file:/a,volatile_cache=64K");
        for bad in [
            "backend = \"mem:1Q\"",
            "[backend]\nkind = \"mem\"\nsize = \"1G\"\nblock_size = 100\n",
            "[backend]\nkind = \"mem\"\nsize = \"1G\"\nbogus = 1\n",
            "[backend]\nkind = \"tape\"\n",
        ] {
            assert!(toml::from_str::<Config>(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn json_serializes_as_string() {
        let spec: BackendSpec = "file:/x,size=1G".parse().unwrap();
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(json, "\"file:/x,size=1G\"");
        let back: BackendSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back, spec);
    }
}
