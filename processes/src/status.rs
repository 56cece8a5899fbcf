//! The states of a process and of a step, as types: the same words as the tables' CHECKs
//! (`processes.status`, `process_steps.status`), read and written as text columns, shown
//! through serde, so no status is a string literal in Rust outside SQL text. (Which states a
//! worker claims, and which steps are final, the SQL decides: the claim's WHERE and the CHECKs.)
//!
//! Process: `pending → running ⇄ waiting → succeeded | failed | compensating → compensated`, and
//! `manual_review` and `cancelled` from any live state (see docs/processes.md).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessStatus {
    /// Started, not claimed yet.
    Pending,
    /// A worker holds its lease and runs its steps.
    Running,
    /// Parked: a retry's backoff, a wait for an event, or a timer. No lease is held.
    Waiting,
    /// Undoing the steps that succeeded, last first.
    Compensating,
    /// Stopped for a person's decision.
    ManualReview,
    /// Every forward step succeeded.
    Succeeded,
    /// A step failed and there was nothing to undo (or a compensation was resolved as failed).
    Failed,
    /// A step failed and every compensation ran.
    Compensated,
    /// An operator cancelled it.
    Cancelled,
}

impl ProcessStatus {
    /// Every state, in the order of the table's CHECK.
    pub const ALL: [ProcessStatus; 9] = [
        ProcessStatus::Pending,
        ProcessStatus::Running,
        ProcessStatus::Waiting,
        ProcessStatus::Succeeded,
        ProcessStatus::Failed,
        ProcessStatus::Compensating,
        ProcessStatus::Compensated,
        ProcessStatus::ManualReview,
        ProcessStatus::Cancelled,
    ];

    /// The word stored in `processes.status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProcessStatus::Pending => "pending",
            ProcessStatus::Running => "running",
            ProcessStatus::Waiting => "waiting",
            ProcessStatus::Compensating => "compensating",
            ProcessStatus::ManualReview => "manual_review",
            ProcessStatus::Succeeded => "succeeded",
            ProcessStatus::Failed => "failed",
            ProcessStatus::Compensated => "compensated",
            ProcessStatus::Cancelled => "cancelled",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Nothing happens to it any more.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            ProcessStatus::Succeeded
                | ProcessStatus::Failed
                | ProcessStatus::Compensated
                | ProcessStatus::Cancelled
        )
    }
}

impl fmt::Display for ProcessStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// Not run yet (or sent back to run again by an operator).
    Pending,
    /// Begun: its call may be under way, or (a wait step) it waits for its event.
    Running,
    /// Failed in a way worth trying again after its backoff.
    Retryable,
    /// Stopped for a person's decision.
    ManualReview,
    /// Done; its result is recorded.
    Succeeded,
    /// Failed for good.
    Failed,
}

impl StepStatus {
    /// Every state, in the order of the table's CHECK.
    pub const ALL: [StepStatus; 6] = [
        StepStatus::Pending,
        StepStatus::Running,
        StepStatus::Succeeded,
        StepStatus::Retryable,
        StepStatus::Failed,
        StepStatus::ManualReview,
    ];

    /// The word stored in `process_steps.status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            StepStatus::Pending => "pending",
            StepStatus::Running => "running",
            StepStatus::Retryable => "retryable",
            StepStatus::ManualReview => "manual_review",
            StepStatus::Succeeded => "succeeded",
            StepStatus::Failed => "failed",
        }
    }

    /// The state named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for StepStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Stored as the table's `text` (its CHECK holds the words), read and written as the word: the
/// same wire type as a `String`, so a query binds and reads it with no type lookup.
macro_rules! text_column {
    ($t:ty, $what:literal) => {
        impl sqlx::Type<sqlx::Postgres> for $t {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $t {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $t {
            fn decode(
                value: sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let s = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Self::parse(s).ok_or_else(|| format!(concat!("not a ", $what, ": {:?}"), s).into())
            }
        }
    };
}

text_column!(ProcessStatus, "process status");
text_column!(StepStatus, "step status");

#[cfg(test)]
mod tests {
    use super::*;

    /// The words round-trip, serde writes the same words as the tables, and the CHECKs of
    /// migration 5 name exactly these states.
    #[test]
    fn the_words_are_the_tables_words() {
        let check = include_str!("../../migrations/0005_processes.sql");
        for s in ProcessStatus::ALL {
            assert_eq!(ProcessStatus::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert!(check.contains(&format!("'{}'", s.as_str())), "{s}");
        }
        for s in StepStatus::ALL {
            assert_eq!(StepStatus::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert!(check.contains(&format!("'{}'", s.as_str())), "{s}");
        }
        assert_eq!(ProcessStatus::parse("paused"), None);
        let terminal: Vec<_> = ProcessStatus::ALL
            .into_iter()
            .filter(|s| s.is_terminal())
            .collect();
        assert_eq!(terminal.len(), 4);
    }
}
