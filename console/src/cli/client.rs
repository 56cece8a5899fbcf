//! The transport of the CLI's API client: one console, one token, JSON in and out, an error
//! answer turned into [`ClientError::Status`] (its message with control characters escaped, for
//! the terminal). The calls themselves are typed methods in [`super::api`].

use serde_json::Value;
use shared::display::escape_control as esc;

/// Why a CLI request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("request to the console failed")]
    Http(#[from] reqwest::Error),
    #[error("the console answered {status}: {message}")]
    Status { status: u16, message: String },
    #[error("writing the output")]
    Io(#[from] std::io::Error),
}

/// A client of one console for one token.
pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(url: &str, token: &str) -> Self {
        Self {
            base: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http: reqwest::Client::new(),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, ClientError> {
        let r = req.bearer_auth(&self.token).send().await?;
        let status = r.status().as_u16();
        if status >= 400 {
            let text = r.text().await.unwrap_or_default();
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or(text);
            return Err(ClientError::Status {
                status,
                message: esc(&message).into_owned(),
            });
        }
        Ok(r)
    }

    /// GETs `path` of the console; an error answer is a [`ClientError::Status`].
    async fn fetch(&self, path: &str) -> Result<reqwest::Response, ClientError> {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    pub async fn get(&self, path: &str) -> Result<Value, ClientError> {
        Ok(self.fetch(path).await?.json().await?)
    }

    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        Ok(self.fetch(path).await?.text().await?)
    }

    /// POSTs `body` with a fresh Idempotency-Key (a retry of the same command would reuse it).
    pub async fn post(
        &self,
        path: &str,
        body: &Value,
        key: &str,
    ) -> Result<(u16, Value), ClientError> {
        let r = self
            .send(
                self.http
                    .post(format!("{}{path}", self.base))
                    .header("Idempotency-Key", key)
                    .json(body),
            )
            .await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await?))
    }
}
