//! The host identity: host NQN and host ID, stable across runs.
//!
//! Targets recognise a host by its NQN (access control) and its 128-bit host identifier
//! (reservations, and telling two hosts with the same NQN apart). Both must stay the same
//! across runs. The identity is read from `/etc/nvme/hostnqn` and `/etc/nvme/hostid` (what
//! nvme-cli and the Linux kernel host use) when they exist; otherwise it is generated once and
//! stored in a state directory (see [`default_state_dir`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// Where nvme-cli keeps the host identity.
pub const ETC_NVME: &str = "/etc/nvme";
/// The state directory used when running as root.
pub const ROOT_STATE_DIR: &str = "/var/lib/nvmeof";

/// A host NQN and host identifier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIdentity {
    /// Host NQN, for example `nqn.2014-08.org.nvmexpress:uuid:…`.
    pub hostnqn: String,
    /// Host identifier (a UUID).
    pub hostid: [u8; 16],
}

impl HostIdentity {
    /// An explicit identity. The NQN must be a valid NQN (starts with `nqn.`, at most 223
    /// bytes).
    pub fn new(hostnqn: &str, hostid: [u8; 16]) -> Result<Self, Error> {
        if !valid_nqn(hostnqn) {
            return Err(Error::InvalidArgument(format!(
                "{hostnqn:?} is not a valid NQN (it must start with \"nqn.\" and be at most 223 bytes)"
            )));
        }
        Ok(HostIdentity {
            hostnqn: hostnqn.to_string(),
            hostid,
        })
    }

    /// The identity from `/etc/nvme` when present, else the one stored in `state_dir`,
    /// generated and stored there on first use.
    pub fn load_or_create(state_dir: &Path) -> Result<Self, Error> {
        Self::load_or_create_from(Path::new(ETC_NVME), state_dir)
    }

    /// Like [`load_or_create`](Self::load_or_create) with another system directory in place
    /// of `/etc/nvme`.
    pub fn load_or_create_from(etc_dir: &Path, state_dir: &Path) -> Result<Self, Error> {
        let from_etc_nqn = read_trimmed(&etc_dir.join("hostnqn")).filter(|s| valid_nqn(s));
        let from_etc_id = read_trimmed(&etc_dir.join("hostid")).and_then(|s| parse_hostid(&s));
        let stored_nqn = || read_trimmed(&state_dir.join("hostnqn")).filter(|s| valid_nqn(s));
        let stored_id = || read_trimmed(&state_dir.join("hostid")).and_then(|s| parse_hostid(&s));

        let hostnqn = from_etc_nqn.or_else(stored_nqn);
        let hostid = from_etc_id.or_else(stored_id);
        let (hostnqn, hostid) = match (hostnqn, hostid) {
            (Some(n), Some(id)) => (n, id),
            (Some(n), None) => {
                // Like nvme-cli: a UUID-based host NQN gives the host ID.
                let id = uuid_of_nqn(&n).unwrap_or_else(|| *uuid::Uuid::new_v4().as_bytes());
                store(state_dir, "hostid", &format_hostid(&id))?;
                (n, id)
            }
            (None, id) => {
                let id = id.unwrap_or_else(|| *uuid::Uuid::new_v4().as_bytes());
                let n = format!(
                    "nqn.2014-08.org.nvmexpress:uuid:{}",
                    uuid::Uuid::from_bytes(id).hyphenated()
                );
                store(state_dir, "hostnqn", &n)?;
                if read_trimmed(&state_dir.join("hostid")).is_none()
                    && read_trimmed(&etc_dir.join("hostid")).is_none()
                {
                    store(state_dir, "hostid", &format_hostid(&id))?;
                }
                (n, id)
            }
        };
        Ok(HostIdentity { hostnqn, hostid })
    }

    /// The host identifier as a UUID string.
    pub fn hostid_string(&self) -> String {
        format_hostid(&self.hostid)
    }
}

/// The default state directory: [`ROOT_STATE_DIR`] for root, else `$XDG_STATE_HOME/nvmeof`,
/// else `~/.local/state/nvmeof`.
pub fn default_state_dir() -> PathBuf {
    if is_root() {
        return PathBuf::from(ROOT_STATE_DIR);
    }
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("nvmeof");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(h) => PathBuf::from(h).join(".local/state/nvmeof"),
        None => std::env::temp_dir().join("nvmeof-state"),
    }
}

/// Whether this process runs with effective user ID 0.
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Parses a host identifier written as a UUID (with or without hyphens).
pub fn parse_hostid(s: &str) -> Option<[u8; 16]> {
    uuid::Uuid::parse_str(s.trim()).ok().map(|u| *u.as_bytes())
}

/// Formats a host identifier as a hyphenated lowercase UUID.
pub fn format_hostid(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

/// Whether `s` looks like an NQN (NVMe Base 2.0 section 4.5): starts with `nqn.` and fits
/// the 223-byte limit.
pub fn valid_nqn(s: &str) -> bool {
    s.starts_with("nqn.") && s.len() <= 223 && s.len() > 4 && !s.contains(char::is_whitespace)
}

fn uuid_of_nqn(nqn: &str) -> Option<[u8; 16]> {
    nqn.split_once(":uuid:").and_then(|(_, u)| parse_hostid(u))
}

fn read_trimmed(path: &Path) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let t = s.trim();
    (!t.is_empty()).then(|| t.to_string())
}

fn store(dir: &Path, name: &str, value: &str) -> Result<(), Error> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Identity(format!("cannot create {}: {e}", dir.display())))?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, format!("{value}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| Error::Identity(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_once_and_stable() {
        let etc = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("sub");
        let a = HostIdentity::load_or_create_from(etc.path(), &dir).unwrap();
        assert!(a.hostnqn.starts_with("nqn.2014-08.org.nvmexpress:uuid:"));
        assert!(a.hostnqn.ends_with(&a.hostid_string()));
        let b = HostIdentity::load_or_create_from(etc.path(), &dir).unwrap();
        assert_eq!(a, b);
        assert!(dir.join("hostnqn").exists() && dir.join("hostid").exists());
    }

    #[test]
    fn etc_nvme_wins() {
        let etc = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        std::fs::write(
            etc.path().join("hostnqn"),
            "nqn.2014-08.org.example:host1\n",
        )
        .unwrap();
        std::fs::write(
            etc.path().join("hostid"),
            "546d87ee-8b73-4df9-b864-934ac408e7da\n",
        )
        .unwrap();
        let id = HostIdentity::load_or_create_from(etc.path(), state.path()).unwrap();
        assert_eq!(id.hostnqn, "nqn.2014-08.org.example:host1");
        assert_eq!(id.hostid_string(), "546d87ee-8b73-4df9-b864-934ac408e7da");
        // Nothing is written when /etc/nvme has both.
        assert!(!state.path().join("hostnqn").exists());
    }

    #[test]
    fn hostid_from_uuid_nqn() {
        let etc = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        std::fs::write(
            etc.path().join("hostnqn"),
            "nqn.2014-08.org.nvmexpress:uuid:e629f254-fe1d-41c0-8690-8747ad3a4574",
        )
        .unwrap();
        let id = HostIdentity::load_or_create_from(etc.path(), state.path()).unwrap();
        assert_eq!(id.hostid_string(), "e629f254-fe1d-41c0-8690-8747ad3a4574");
    }

    #[test]
    fn validation() {
        assert!(HostIdentity::new("host", [0; 16]).is_err());
        assert!(HostIdentity::new("nqn.2014-08.org.example:a", [0; 16]).is_ok());
        assert_eq!(parse_hostid("not a uuid"), None);
    }
}
