//! Where an outbox row is in its life ([`RowState`]).

use serde::Serialize;

/// Where a row is in its life (the CHECK of `messages.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RowState {
    /// Committed, not yet confirmed by the broker.
    Pending,
    /// Confirmed (kept only with a retention).
    Published,
    /// Out of attempts, or unpublishable: waits for a person.
    Dead,
}

impl RowState {
    pub fn as_str(self) -> &'static str {
        match self {
            RowState::Pending => "pending",
            RowState::Published => "published",
            RowState::Dead => "dead",
        }
    }
}

impl TryFrom<String> for RowState {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "pending" => Ok(RowState::Pending),
            "published" => Ok(RowState::Published),
            "dead" => Ok(RowState::Dead),
            _ => Err(format!("not a row state: {s:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RowState;

    #[test]
    fn a_row_state_reads_back_as_the_word_it_is_stored_as() {
        for s in [RowState::Pending, RowState::Published, RowState::Dead] {
            assert_eq!(RowState::try_from(s.as_str().to_string()), Ok(s));
        }
        assert!(RowState::try_from("gone".to_string()).is_err());
    }
}
