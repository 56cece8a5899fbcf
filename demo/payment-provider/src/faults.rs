//! Injected faults: the `mode:percent,...` syntax of `PROVIDER_FAULTS` and `POST /admin/faults`,
//! and the seeded random draw that decides, per `POST /charges` and per webhook event, which of
//! them strike. The charge modes apply to requests, the `webhook_*` modes to the events of async
//! mode (see [`crate::webhooks`]); one set holds both, so they combine freely.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

/// A way the provider misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultMode {
    /// Answer 503 before doing anything: nothing is charged.
    ErrorBeforeCharge,
    /// Commit the charge, then answer only after `PROVIDER_TIMEOUT_DELAY` (the caller gave up).
    TimeoutAfterCharge,
    /// Commit the charge, then reset the TCP connection without answering.
    ResetAfterCharge,
    /// Wait `PROVIDER_SLOW_DELAY` (2 s) before handling the request.
    Slow,
    /// Decline the charge (402): definitive, recorded as `declined`. In async mode the charge
    /// answers 202 `pending` and is decided `declined` later (`charge.failed`).
    Decline,
    /// The event is recorded but never sent (the provider "lost" it).
    WebhookLost,
    /// The event is sent twice: once more right after its first successful delivery.
    WebhookDuplicate,
    /// The event's first delivery waits `PROVIDER_WEBHOOK_DELAY`.
    WebhookDelay,
    /// The event is held back until the next event of the same charge was delivered (at most
    /// `PROVIDER_WEBHOOK_REORDER_WINDOW`), so the later event arrives first.
    WebhookReorder,
    /// The first delivery is counted as failed whatever the receiver answered (as if a proxy had
    /// turned its 2xx into a 503), so the same event is retried after a backoff.
    Webhook5xxRetry,
}

impl FaultMode {
    /// Every mode, in the order they are drawn for a request.
    pub const ALL: [FaultMode; COUNT] = [
        FaultMode::Slow,
        FaultMode::ErrorBeforeCharge,
        FaultMode::Decline,
        FaultMode::ResetAfterCharge,
        FaultMode::TimeoutAfterCharge,
        FaultMode::WebhookLost,
        FaultMode::WebhookDuplicate,
        FaultMode::WebhookDelay,
        FaultMode::WebhookReorder,
        FaultMode::Webhook5xxRetry,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultMode::ErrorBeforeCharge => "error_before_charge",
            FaultMode::TimeoutAfterCharge => "timeout_after_charge",
            FaultMode::ResetAfterCharge => "reset_after_charge",
            FaultMode::Slow => "slow",
            FaultMode::Decline => "decline",
            FaultMode::WebhookLost => "webhook_lost",
            FaultMode::WebhookDuplicate => "webhook_duplicate",
            FaultMode::WebhookDelay => "webhook_delay",
            FaultMode::WebhookReorder => "webhook_reorder",
            FaultMode::Webhook5xxRetry => "webhook_5xx_retry",
        }
    }

    fn index(self) -> usize {
        match self {
            FaultMode::Slow => 0,
            FaultMode::ErrorBeforeCharge => 1,
            FaultMode::Decline => 2,
            FaultMode::ResetAfterCharge => 3,
            FaultMode::TimeoutAfterCharge => 4,
            FaultMode::WebhookLost => 5,
            FaultMode::WebhookDuplicate => 6,
            FaultMode::WebhookDelay => 7,
            FaultMode::WebhookReorder => 8,
            FaultMode::Webhook5xxRetry => 9,
        }
    }
}

/// How many fault modes there are.
const COUNT: usize = 10;

impl FromStr for FaultMode {
    type Err = FaultSyntaxError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FaultMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| FaultSyntaxError::UnknownMode(s.to_string()))
    }
}

/// Why a fault list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultSyntaxError {
    #[error(
        "unknown fault mode {0:?}: expected error_before_charge, timeout_after_charge, reset_after_charge, slow, decline, webhook_lost, webhook_duplicate, webhook_delay, webhook_reorder or webhook_5xx_retry"
    )]
    UnknownMode(String),
    #[error("fault {0:?} is not of the form mode:percent")]
    Malformed(String),
    #[error("fault {mode}: percent {value:?} is not a whole number from 0 to 100")]
    BadPercent { mode: &'static str, value: String },
    #[error("fault {0} is given twice")]
    Duplicate(&'static str),
}

/// The percent of requests each mode strikes (0 = off). Parsed from `mode:percent,...`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultSet {
    percent: [u8; COUNT],
}

impl FaultSet {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// The percent of requests `mode` strikes.
    pub fn percent(&self, mode: FaultMode) -> u8 {
        self.percent[mode.index()]
    }

    /// The same set with `mode` at `percent` (capped at 100).
    pub fn with(mut self, mode: FaultMode, percent: u8) -> Self {
        self.percent[mode.index()] = percent.min(100);
        self
    }
}

impl FromStr for FaultSet {
    type Err = FaultSyntaxError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut set = FaultSet::none();
        let mut seen = [false; COUNT];
        for item in s.split(',').map(str::trim) {
            if item.is_empty() && s.trim().is_empty() {
                continue;
            }
            let (mode, percent) = item
                .split_once(':')
                .ok_or_else(|| FaultSyntaxError::Malformed(item.to_string()))?;
            let mode: FaultMode = mode.trim().parse()?;
            let value = percent.trim();
            let percent = value
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= 100 && value.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| FaultSyntaxError::BadPercent {
                    mode: mode.as_str(),
                    value: value.to_string(),
                })?;
            if std::mem::replace(&mut seen[mode.index()], true) {
                return Err(FaultSyntaxError::Duplicate(mode.as_str()));
            }
            set = set.with(mode, percent);
        }
        Ok(set)
    }
}

/// `mode:percent,...` of the modes that are on, in [`FaultMode::ALL`] order; empty when none is.
impl fmt::Display for FaultSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for mode in FaultMode::ALL {
            let p = self.percent(mode);
            if p > 0 {
                if !first {
                    f.write_str(",")?;
                }
                write!(f, "{}:{p}", mode.as_str())?;
                first = false;
            }
        }
        Ok(())
    }
}

/// Which faults strike one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Strikes {
    struck: [bool; COUNT],
}

impl Strikes {
    pub fn has(&self, mode: FaultMode) -> bool {
        self.struck[mode.index()]
    }
}

/// The current fault set and the random generator, behind one lock so that a seeded run draws the
/// same sequence for the same sequence of requests.
#[derive(Debug)]
pub struct FaultInjector {
    inner: Mutex<(FaultSet, StdRng)>,
}

impl FaultInjector {
    /// `seed` makes the draws replayable (`PROVIDER_SEED`); without it they come from the OS.
    pub fn new(set: FaultSet, seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Self {
            inner: Mutex::new((set, rng)),
        }
    }

    pub fn current(&self) -> FaultSet {
        self.lock().0
    }

    pub fn set(&self, set: FaultSet) {
        self.lock().0 = set;
    }

    /// Draws every mode once (in [`FaultMode::ALL`] order, whether it is on or not, so that the
    /// sequence does not depend on the configuration) and says which strike.
    pub fn draw(&self) -> Strikes {
        let mut guard = self.lock();
        let (set, rng) = &mut *guard;
        let mut strikes = Strikes::default();
        for mode in FaultMode::ALL {
            let roll: u8 = rng.random_range(0..100);
            strikes.struck[mode.index()] = roll < set.percent(mode);
        }
        strikes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (FaultSet, StdRng)> {
        // The data stays consistent even if a holder panicked: take it back.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let set: FaultSet = " decline:5, timeout_after_charge:100 ,slow:0"
            .parse()
            .unwrap();
        assert_eq!(set.percent(FaultMode::Decline), 5);
        assert_eq!(set.percent(FaultMode::TimeoutAfterCharge), 100);
        assert_eq!(set.to_string(), "decline:5,timeout_after_charge:100");
        assert_eq!("".parse::<FaultSet>().unwrap(), FaultSet::none());
        assert_eq!("  ".parse::<FaultSet>().unwrap(), FaultSet::none());
    }

    #[test]
    fn refuses_bad_syntax() {
        for bad in [
            "decline",
            "decline:101",
            "decline:-1",
            "decline:+5",
            "decline:5.5",
            "nope:5",
            "decline:5,decline:6",
            "decline:5,",
            ",",
        ] {
            assert!(bad.parse::<FaultSet>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn webhook_modes_combine_with_charge_modes() {
        let set: FaultSet = "webhook_reorder:20,decline:5,webhook_lost:10,webhook_5xx_retry:1"
            .parse()
            .unwrap();
        assert_eq!(set.percent(FaultMode::WebhookReorder), 20);
        assert_eq!(set.percent(FaultMode::Webhook5xxRetry), 1);
        assert_eq!(
            set.to_string(),
            "decline:5,webhook_lost:10,webhook_reorder:20,webhook_5xx_retry:1"
        );
    }

    #[test]
    fn hundred_always_strikes_zero_never() {
        let f = FaultInjector::new("decline:100".parse().unwrap(), Some(1));
        for _ in 0..200 {
            let s = f.draw();
            assert!(s.has(FaultMode::Decline));
            assert!(!s.has(FaultMode::Slow));
        }
    }

    #[test]
    fn a_seed_replays() {
        let set: FaultSet = "decline:50,slow:30".parse().unwrap();
        let a = FaultInjector::new(set, Some(7));
        let b = FaultInjector::new(set, Some(7));
        let xs: Vec<_> = (0..100).map(|_| a.draw()).collect();
        let ys: Vec<_> = (0..100).map(|_| b.draw()).collect();
        assert_eq!(xs, ys);
    }
}
