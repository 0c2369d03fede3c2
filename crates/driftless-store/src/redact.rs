//! Keep credentials and pre-signed query strings out of errors and logs.

/// Redact a URL: drop user/password, query string and fragment.
pub(crate) fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.has_host() || u.scheme() == "file" => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        _ => redact_as_typed(url),
    }
}

/// Redact a URL without parsing (and so without normalizing) it: cut at the first '?' or '#'
/// and drop anything before an '@'. For echoing back a value the user typed wrong as typed
/// (`http:/h:1` must not come back as `http://h:1/`).
pub(crate) fn redact_as_typed(url: &str) -> String {
    let cut = url.find(['?', '#']).unwrap_or(url.len());
    let s = &url[..cut];
    match (s.find("://"), s.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => format!("{}{}", &s[..scheme_end + 3], &s[at + 1..]),
        (None, Some(at)) => s[at + 1..].to_string(),
        _ => s.to_string(),
    }
}

/// Redact every `http(s)://` URL inside free text (error messages from the HTTP client).
pub(crate) fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let next = [rest.find("http://"), rest.find("https://")].into_iter().flatten().min();
        match next {
            None => {
                out.push_str(rest);
                return out;
            }
            Some(start) => {
                out.push_str(&rest[..start]);
                let tail = &rest[start..];
                let end = tail
                    .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | ')' | ','))
                    .unwrap_or(tail.len());
                out.push_str(&redact_url(&tail[..end]));
                rest = &tail[end..];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_userinfo_and_query() {
        assert_eq!(redact_url("https://user:pw@host.example/b/k?X-Amz-Signature=abc"), "https://host.example/b/k");
        assert_eq!(redact_url("s3://bucket/prefix?secret=1"), "s3://bucket/prefix");
        assert_eq!(
            redact_text("GET https://h/k?sig=1 failed, see http://a:b@h2/x"),
            "GET https://h/k failed, see http://h2/x"
        );
    }
}
