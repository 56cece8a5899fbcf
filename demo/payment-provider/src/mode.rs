//! [`ConfirmationMode`]: whether `POST /charges` decides at once (`sync`, 201/402) or answers 202
//! `pending` and confirms later by webhook (`async`); and [`ModeSwitch`], the mode in force,
//! changed at run time by `POST /admin/mode`.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};

/// How the provider confirms a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConfirmationMode {
    /// The answer of `POST /charges` is the outcome (201 succeeded, 402 declined).
    Sync,
    /// `POST /charges` answers 202 with the charge `pending`; the outcome follows after
    /// `PROVIDER_CONFIRM_DELAY` as a signed webhook event (`charge.succeeded`, `charge.failed`).
    Async,
}

impl ConfirmationMode {
    /// The value of `provider.charges.confirmation`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConfirmationMode::Sync => "sync",
            ConfirmationMode::Async => "async",
        }
    }
}

impl std::str::FromStr for ConfirmationMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sync" => Ok(ConfirmationMode::Sync),
            "async" => Ok(ConfirmationMode::Async),
            _ => Err(format!("{s:?}: expected sync or async")),
        }
    }
}

impl std::fmt::Display for ConfirmationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The mode in force, shared by every handler.
#[derive(Debug)]
pub struct ModeSwitch(AtomicBool);

impl ModeSwitch {
    pub fn new(mode: ConfirmationMode) -> Self {
        Self(AtomicBool::new(mode == ConfirmationMode::Async))
    }

    pub fn get(&self) -> ConfirmationMode {
        if self.0.load(Ordering::SeqCst) {
            ConfirmationMode::Async
        } else {
            ConfirmationMode::Sync
        }
    }

    pub fn set(&self, mode: ConfirmationMode) {
        self.0
            .store(mode == ConfirmationMode::Async, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_switches() {
        assert_eq!(
            "async".parse::<ConfirmationMode>(),
            Ok(ConfirmationMode::Async)
        );
        assert!("later".parse::<ConfirmationMode>().is_err());
        let m = ModeSwitch::new(ConfirmationMode::Sync);
        m.set(ConfirmationMode::Async);
        assert_eq!(m.get(), ConfirmationMode::Async);
        assert_eq!(m.get().to_string(), "async");
    }
}
