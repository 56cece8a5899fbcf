//! The states of a circuit, as a type: the same words as `dependencies.state`'s CHECK.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a dependency's circuit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    /// Calls go through; unavailable answers are counted.
    Closed,
    /// The remote is down: calls wait until the probe time.
    Open,
    /// One probe call is in flight; the others wait for its answer.
    HalfOpen,
}

impl CircuitState {
    /// Every state, in the order of the table's CHECK.
    pub const ALL: [CircuitState; 3] = [
        CircuitState::Closed,
        CircuitState::Open,
        CircuitState::HalfOpen,
    ];

    /// The word stored in `dependencies.state`.
    pub const fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// The gauge's value: 0 closed, 1 half open, 2 open.
    pub const fn gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::HalfOpen => 1.0,
            CircuitState::Open => 2.0,
        }
    }
}

impl fmt::Display for CircuitState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_parses_back() {
        for s in CircuitState::ALL {
            assert_eq!(CircuitState::parse(s.as_str()), Some(s));
        }
        assert_eq!(CircuitState::parse("ajar"), None);
    }
}
