//! A real browser for the console's tests: headless Chromium driven through chromedriver
//! (`apt-get install chromium chromium-driver`; `.ci/run` does), and the few page actions the
//! tests share.

use crate::{TempDir, free_addr, wait_until};
use fantoccini::{Client, Locator, elements::Element};
use serde_json::json;
use std::time::Duration;

/// A chromedriver child process (killed when dropped) and the Chromium profile directory
/// (removed when dropped).
pub struct Chromedriver {
    child: std::process::Child,
    url: String,
    profile: TempDir,
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts chromedriver on a free port and opens a headless Chromium session with a profile of
/// its own; panics with what to install when either binary is missing.
pub async fn chromedriver() -> (Chromedriver, Client) {
    for bin in ["/usr/bin/chromedriver", "/usr/bin/chromium"] {
        assert!(
            std::path::Path::new(bin).exists(),
            "{bin} missing: apt-get install -y chromium chromium-driver (.ci/run does)"
        );
    }
    let port = free_addr().port();
    let child = std::process::Command::new("/usr/bin/chromedriver")
        .arg(format!("--port={port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let url = format!("http://127.0.0.1:{port}");
    let driver = Chromedriver {
        child,
        url: url.clone(),
        profile: TempDir::new("chromium_profile"),
    };
    wait_until("chromedriver listens", Duration::from_secs(60), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
    })
    .await;
    let mut caps = serde_json::Map::new();
    caps.insert("browserName".into(), json!("chrome"));
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--window-size=1400,1800",
                format!("--user-data-dir={}", driver.profile.path().display()),
            ]
        }),
    );
    let client =
        fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&driver.url)
            .await
            .expect("a chromium session");
    (driver, client)
}

/// Waits for the element with `id`; on timeout fails with the page the browser shows.
pub async fn wait_for(b: &Client, id: &str) -> Element {
    match b
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(Locator::Id(id))
        .await
    {
        Ok(e) => e,
        Err(e) => {
            let url = b
                .current_url()
                .await
                .map(|u| u.to_string())
                .unwrap_or_default();
            let source = b.source().await.unwrap_or_default();
            panic!("#{id} did not appear ({e}); the browser shows {url}:\n{source}");
        }
    }
}

/// Clicks the element with `id` and waits until the browser has left the page it was on (that
/// page's root element is gone), so what is read next is the page the click loaded. chromedriver's
/// click returns once the click is dispatched; for a link or a form's POST that can be before the
/// next page has come, and reading at once read the page being left (a paging line both pages
/// have, an `#error` only the next one has). For a click that changes the page in place (a
/// checkbox, a `<details>`), use [`click`].
pub async fn follow(b: &Client, id: &str) {
    let page = b.find(Locator::Css("html")).await.unwrap();
    click(b, id).await;
    wait_until(
        &format!("the browser to leave the page after a click on #{id}"),
        Duration::from_secs(60),
        || async {
            match page.tag_name().await {
                Err(e) if e.is_stale_element_reference() || e.is_no_such_element() => Some(()),
                _ => None,
            }
        },
    )
    .await;
}

/// Clicks the element with `id`, staying on the page (see [`follow`] for a click that loads one).
pub async fn click(b: &Client, id: &str) {
    b.find(Locator::Id(id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Types `text` into the element with `id`.
pub async fn type_into(b: &Client, id: &str, text: &str) {
    b.find(Locator::Id(id))
        .await
        .unwrap()
        .send_keys(text)
        .await
        .unwrap();
}
