//! `driftless publish`: one checkpoint per call (`--step N CKPT`) or follow a directory
//! (`--watch DIR`). The snapshot of the last published state is the checkpoint itself, saved
//! atomically in `--state DIR` (see [`state`]) so a later call diffs against it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use driftless_format::Checkpoint;
use driftless_publisher::{Outcome, PublisherBuilder};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    bucket: super::bucket::BucketArgs,
    /// Signing key (PKCS#8 PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// State directory (keeps the last published checkpoint between calls).
    #[arg(long)]
    state: PathBuf,
    /// Step number of CKPT.
    #[arg(long, requires = "ckpt")]
    step: Option<u64>,
    /// Anchor every K steps.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    anchor_every: u64,
    /// Follow DIR: publish each `step_N` directory or `step_N.safetensors` file in order,
    /// once complete (an index with all its shards, all `-of-N` shards, --complete-file, or
    /// a rename from a temporary name such as `step_N.tmp`).
    #[arg(long, conflicts_with = "ckpt")]
    watch: Option<PathBuf>,
    /// With --watch: a step directory is complete only once it holds this file (written by
    /// the trainer after its last shard).
    #[arg(long, requires = "watch")]
    complete_file: Option<String>,
    /// Prefix of the step entries in --watch (followed by the step number).
    #[arg(long, default_value = "step_")]
    pattern: String,
    /// Exit after publishing what is in --watch now.
    #[arg(long)]
    once: bool,
    /// Leave out the checkpoint's non-weight files whose name matches GLOB (`*` and `?`;
    /// repeatable), besides the training state left out by default (see the README): a file
    /// that changes every step would make every step an anchor.
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Create the stream even if the prefix holds other objects.
    #[arg(long)]
    new_stream: bool,
    /// Continue a stream signed by another key (key rotation, a replaced trainer): re-signs
    /// its descriptor with --key. Agents must trust the new key.
    #[arg(long)]
    takeover: bool,
    /// Run retention after every step whose number is a multiple of N, and every N steps a
    /// `--watch` publishes (0 = never), with the gc defaults.
    #[arg(long, default_value_t = 0)]
    gc_every: u64,
    /// JSON lines on stdout (one `{"type":"published","data":{...}}` per step).
    #[arg(long)]
    json: bool,
    /// Checkpoint to publish (file or directory).
    ckpt: Option<PathBuf>,
}

impl Args {
    /// Whether this follows a directory (a long-running command).
    pub fn watching(&self) -> bool {
        self.watch.is_some() && !self.once
    }
}

pub fn run(a: Args) -> Result<()> {
    std::fs::create_dir_all(&a.state).with_context(|| format!("creating state directory {}", a.state.display()))?;
    // One process per state directory (found by review: two followers of one checkpoint
    // directory staged, saved and pruned the same snapshots under each other). Held until the
    // command ends; the kernel drops it with a killed process.
    let _lock = driftless_store::lockfile::lock_dir(&a.state, "driftless publish (one per --state directory)", true)?;
    if a.key.is_none() {
        eprintln!("driftless: warning: no --key: the stream is unsigned; agents need --allow-unsigned");
    }
    let mut published = 0u64;
    if let (Some(step), Some(ckpt)) = (a.step, a.ckpt.as_deref()) {
        let mut p = open(&a)?;
        if let Err(e) = publish_one(&a, &mut p, step, ckpt, &mut published) {
            // Already flushed and published again where it could be: no second round of
            // retries on the way out (dropping the publisher would flush).
            p.abort();
            return Err(e);
        }
        return Ok(p.close()?);
    }
    let Some(dir) = a.watch.clone() else { bail!("give --step N CKPT or --watch DIR") };
    stop::install();
    // A follower outlives bucket outages: a failure that retrying can help (the bucket
    // unreachable or throttling past the store's own retries, a step that failed and that
    // `flush` could not publish again) reopens the publisher after a backoff, as a supervisor's restart would. The
    // reopened publisher takes a new generation and resumes after the newest *committed*
    // step, so the failed step is published again (as a delta from the saved state when that
    // is still the bucket's newest step): the newest checkpoint always reaches the bucket.
    // Anything else (a refused stream, another publisher, bad input) still ends the command,
    // and so do RETRY_TRIES failures in a row with no step published in between (a failure
    // that only looks temporary, e.g. a background encode that fails every time): exit 2, for
    // the supervisor.
    let mut last_done: Option<u64> = None;
    // The step whose failure led to a reopening, until a publisher commits it: a stop in the
    // meantime is not clean (found by review: a signal during the reopen's `open`, which
    // seeds from the saved state, was seen by `follow` before the step was tried again, and
    // the follower exited 0 saying it stopped cleanly, with the newest step not published).
    let mut failed: Option<u64> = None;
    let mut backoff = RETRY_MIN;
    let mut tries = 0;
    loop {
        let before = published;
        let r =
            open(&a).and_then(|mut p| match follow(&a, &dir, &mut p, &mut published, &mut last_done, &mut failed) {
                Ok(()) => Ok(()),
                Err(e) => {
                    // The reopened publisher publishes the failed step again; no flush on the way.
                    p.abort();
                    Err(e)
                }
            });
        let e = match r {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if a.once || stop::requested().is_some() || crate::exit::classify(&e) != crate::exit::Class::Retryable {
            return Err(e);
        }
        if published > before {
            (backoff, tries) = (RETRY_MIN, 0);
        }
        tries += 1;
        if tries > RETRY_TRIES {
            eprintln!("driftless publish: {RETRY_TRIES} reopenings in a row published nothing; giving up");
            return Err(e);
        }
        eprintln!(
            "driftless publish: warning: {}; this looks temporary: reopening the bucket in {} s and publishing the step again",
            crate::exit::render(&e),
            backoff.as_secs()
        );
        let until = std::time::Instant::now() + backoff;
        while std::time::Instant::now() < until && stop::requested().is_none() {
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(sig) = stop::requested() {
            // Not a clean stop: the step that failed is not in the bucket (unless a lost
            // response hid its commit), so a supervisor must see a failure (exit 2) and start
            // the follower again; the next run resumes from the bucket.
            match last_done {
                Some(s) => eprintln!("driftless publish: {sig} while waiting to retry; stopped with the failed step NOT published (the last step this run published is {s})"),
                None => eprintln!("driftless publish: {sig} while waiting to retry; stopped with the failed step NOT published (this run published no step)"),
            }
            return Err(e);
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// Backoff between reopenings of a `--watch` publisher after a temporary failure.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// Reopenings in a row without a published step before `--watch` gives up (~8 minutes).
const RETRY_TRIES: u32 = 20;

/// Opens the publisher and seeds it from the saved state.
fn open(a: &Args) -> Result<driftless_publisher::Publisher> {
    let key = super::signing_key(a.key.as_deref())?;
    let mut b = PublisherBuilder::new(a.bucket.bucket.clone())
        .with_bucket(a.bucket.open()?)
        .with_anchor_every(a.anchor_every)
        .with_new_stream(a.new_stream)
        .with_takeover(a.takeover)
        .with_spool_dir(a.state.join("spool"));
    if let Some(k) = key {
        b = b.with_key(k);
    }
    // The non-weight files of the last committed step (saved with it), so that a step whose
    // files changed ships them (seeded from the new CKPT, a change was never seen: agents kept
    // the old config.json), and a --watch restart does not take unchanged files for new ones
    // (an extra anchor). Without a saved state: the CKPT's.
    let saved = state::load(&a.state);
    match (&saved, a.ckpt.as_deref()) {
        (Some((_, dir)), _) => b = b.with_extra_files(extra_files(dir, &a.exclude)),
        (None, Some(c)) => b = b.with_extra_files(extra_files(c, &a.exclude)),
        (None, None) => {}
    }
    let mut p = b.build()?;
    // The publisher restarts with no snapshot in a new process: seed it from the saved copy,
    // which it checks against the bucket (and brings forward over steps committed after it).
    if let Some((step, dir)) = saved {
        match super::open(&dir).and_then(|ck| Ok(p.seed(step, &ck.views(), &stable_layout(&ck, &dir))?)) {
            Ok(()) => {}
            Err(e) => eprintln!(
                "driftless publish: warning: {}; the next step is published as an anchor",
                crate::exit::render(&e)
            ),
        }
    }
    Ok(p)
}

/// Publishes one checkpoint, waits for its uploads, saves the state and prints the summary.
///
/// A `--step` CKPT may be a path the trainer rewrites in place (the next save into the same
/// directory, a truncate): read while it changed, it published bytes of two checkpoints (an
/// anchor even signed over a first read that differed from what it encoded, which every agent
/// refused), or died of SIGBUS. So it is first copied into the state directory, checked
/// unchanged by the copy (`state::stage`), and published from that copy, which then becomes
/// the saved state (hard links, no second copy). A `--watch` entry is a new directory per step
/// that the trainer does not rewrite: read where it is.
fn publish_one(
    a: &Args,
    p: &mut driftless_publisher::Publisher,
    step: u64,
    ckpt: &Path,
    published: &mut u64,
) -> Result<()> {
    // A --watch entry is linked instead (the trainer does not rewrite it, but its retention
    // may delete it while the step uploads: the links keep the files for the saved state).
    // Linked files are the trainer's: one it rewrites in place while the publisher reads it
    // refuses the step there (`publish_checked`), and the step is staged and read again.
    // One budget of reads for the staging and the check after the publisher's read together
    // (found by review: three stagings inside each of three reads, up to nine reads of a
    // checkpoint that changes at every one).
    let mut reads = 0;
    loop {
        let staged = match state::stage(&a.state, step, ckpt, a.watch.is_some(), &a.exclude, &mut reads) {
            Err(e) if e.downcast_ref::<Unsettled>().is_none() && !ckpt.exists() => {
                return Err(Unsettled(format!(
                    "{} was removed while it was read ({}): step {step} was not published",
                    ckpt.display(),
                    crate::exit::render(&e)
                ))
                .into());
            }
            r => r?,
        };
        let r = publish_from(a, p, step, &staged, published);
        let _ = std::fs::remove_dir_all(&staged);
        let changed = matches!(
            r.as_ref().err().and_then(|e| e.downcast_ref::<driftless_publisher::Error>()),
            Some(driftless_publisher::Error::InputChanged { .. })
        );
        if !changed {
            return r;
        }
        reads += 1;
        read_again(ckpt, step, reads)?;
    }
}

/// A checkpoint that could not be read as one state: it changed at every try, or it was
/// removed while it was read (a trainer's retention). Nothing of it reached the bucket, and
/// reading it again later can help: `--step` exits 2 ("retrying may help"); `--watch` goes on
/// and reads the entry again at its next scan, if it is still there (found by review: the
/// follower exited, so a trainer slow to finish a save, or deleting old checkpoints while
/// the publisher was behind, stopped publishing for good).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unsettled(String);

/// After try `attempt` (of 3) found `path` changed while it was read: the error once the
/// third did, else a warning and a pause before the next.
fn read_again(path: &Path, step: u64, attempt: u32) -> Result<()> {
    if attempt >= 3 {
        return Err(Unsettled(format!(
            "{} changed while it was read, three times (is the trainer still writing it?): step {step} was not published; publish a checkpoint once it is written",
            path.display()
        ))
        .into());
    }
    eprintln!("driftless publish: warning: {} changed while it was read; reading it again", path.display());
    std::thread::sleep(std::time::Duration::from_millis(500));
    Ok(())
}

fn publish_from(
    a: &Args,
    p: &mut driftless_publisher::Publisher,
    step: u64,
    ckpt: &Path,
    published: &mut u64,
) -> Result<()> {
    let ck = super::open(ckpt)?;
    let changed = p.set_extra_files(extra_files(ckpt, &a.exclude))?;
    if !changed.is_empty() && p.snapshot_step().is_some() {
        // Every reader must get the new files, so the step is an anchor (100x a delta): say
        // which files did it, so that one the servers do not need can be left out.
        eprintln!(
            "driftless publish: warning: step {step}: {} changed: publishing an anchor so that agents get the new files (--exclude GLOB leaves out a file the servers do not need)",
            changed.join(", ")
        );
    }
    let before = p.status().bytes_uploaded;
    // The shards as the publisher reads them: hard links of a `--watch` entry are the
    // trainer's own files, which it may rewrite in place while they are read (a staged copy
    // is the command's own and never changes). Checked again once the publisher has its copy
    // of the weights, before anything of the step is queued (found by review: a `--watch`
    // step read during such a rewrite was published mixing the two saves).
    let stamps = state::stamps(ckpt, &a.exclude)?;
    let (dir, exclude) = (ckpt.to_path_buf(), a.exclude.clone());
    let unchanged = move || {
        #[cfg(test)]
        tests::IN_CHECK.with(|h| (h.borrow_mut().0)(&dir));
        state::stamps(&dir, &exclude).is_ok_and(|now| now == stamps)
    };
    #[cfg(test)]
    tests::BEFORE_READ.with(|h| (h.borrow_mut().0)(ckpt));
    let mut r = p.publish_checked(step, &ck.views(), &stable_layout(&ck, ckpt), unchanged)?;
    if let Err(e) = flush_with_progress(p, a.json) {
        if is_taken(&e) {
            // Claimed by a killed predecessor: publishing it again cannot help.
            return Err(e);
        }
        // The step (or its anchor) failed past the store's retries: `flush` publishes it
        // again, once, as an anchor of the publisher's copy, and errors only when it is still
        // not in the bucket (or another publisher took the stream).
        eprintln!("driftless publish: warning: {}; publishing step {step} again as an anchor", crate::exit::render(&e));
        p.flush()?;
        let st = p.status();
        if st.last_delta_ready != Some(step) && st.last_anchor_ready == Some(step) {
            // Its delta never landed: what is in the bucket is the anchor `flush` published.
            (r.outcome, r.delta_bytes, r.ratio) = (Outcome::Anchor, None, None);
        }
    }
    if r.delta_bytes.is_none() && r.outcome == Outcome::Delta {
        // Encoded after publish() returned; flushed, so the status has this step's size.
        let st = p.status();
        (r.delta_bytes, r.ratio) = (Some(st.last_delta_bytes), Some(st.last_ratio));
    }
    // Everything this step put in the bucket (delta, anchor, markers): an anchor's size
    // is only known once its background upload is done.
    let uploaded = p.status().bytes_uploaded.saturating_sub(before);
    // Saved only once the step is committed: a crash before this leaves the previous
    // state, which `seed` brings forward from the bucket on the next run.
    if p.snapshot_step() == Some(step) {
        // Linked from the staged copy (1 GiB: 2 s of copy and sync per step saved). The step
        // is committed whatever happens here: a failure costs the next run an anchor.
        if let Err(e) = state::save(&a.state, step, ckpt, true) {
            eprintln!(
                "driftless publish: warning: step {step} is published, but its state could not be saved ({}); the next run publishes an anchor",
                crate::exit::render(&e)
            );
        }
    }
    // The summary is the command's data: stdout. Progress and warnings go to stderr.
    let outcome = super::snake(&r.outcome);
    if a.json {
        let mut data = serde_json::to_value(&r)?;
        data["bytes_uploaded"] = uploaded.into();
        println!("{}", serde_json::json!({"type": "published", "data": data}));
    } else if let (Some(bytes), Some(ratio)) = (r.delta_bytes, r.ratio) {
        println!(
            "step {step}: {outcome}, {uploaded} bytes uploaded (delta {bytes} bytes, {ratio:.1}x smaller than dense, {:.3}% changed)",
            100.0 * r.density
        );
    } else {
        println!("step {step}: {outcome}, {uploaded} bytes uploaded");
    }
    *published += 1;
    // By step number too: each `--step` run is a new process whose count starts at 1, so a
    // count alone never reached N > 1 there (found by review).
    if a.gc_every > 0 && (step.is_multiple_of(a.gc_every) || (*published).is_multiple_of(a.gc_every)) {
        // The step is published: a failed collection is a warning, not a failed step (as an
        // error it aborted `--step` after the commit and reopened `--watch` under a new
        // generation; found by review). The next collection finishes the job.
        if let Err(e) = collect(a) {
            eprintln!(
                "driftless publish: warning: step {step} is published, but retention failed: {}",
                crate::exit::render(&e)
            );
        }
    }
    Ok(())
}

/// One collection with the gc defaults, checking manifests against this publisher's own key.
fn collect(a: &Args) -> Result<()> {
    let trust = super::signing_key(a.key.as_deref())?.map(|k| driftless_format::TrustSet::new().with_key(k.public()));
    let bucket = a.bucket.open()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(driftless_gc::run(&bucket, &driftless_gc::GcPolicy::new().with_trust(trust), false))?;
    Ok(())
}

/// `--watch`: publishes each complete step entry of `dir` in order until a signal (or, with
/// `--once`, until the directory is drained); returns `Ok` once stopped cleanly.
fn follow(
    a: &Args,
    dir: &Path,
    p: &mut driftless_publisher::Publisher,
    published: &mut u64,
    last_done: &mut Option<u64>,
    failed: &mut Option<u64>,
) -> Result<()> {
    let mut warned = std::collections::BTreeSet::new();
    let mut skipped = std::collections::BTreeSet::new();
    let mut warned_below = std::collections::BTreeSet::new();
    loop {
        let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter_map(|e| Some((step_of(&e.file_name().to_string_lossy(), &a.pattern)?, e.path())))
            .collect();
        steps.sort();
        let twice: std::collections::BTreeSet<u64> =
            steps.windows(2).filter(|w| w[0].0 == w[1].0).map(|w| w[0].0).collect();
        // Entries at or below the bucket's newest step are not published. When that step is
        // not among them (a stray `step_99999999` published once, or a trainer that numbers
        // from 0 again), say so once: found by review, every later checkpoint was skipped
        // silently.
        if let Some(l) = p.status().last_published {
            let newest_below = steps.iter().map(|(t, _)| *t).filter(|&t| t <= l).max();
            if let Some(t) = newest_below.filter(|_| !steps.iter().any(|(t, _)| *t == l)) {
                if warned_below.insert(l) {
                    eprintln!(
                        "driftless publish: warning: the bucket's newest step is {l}, which {} does not hold: \
                         its entries up to step {t} are not published (steps must increase; \
                         a trainer numbering from 0 again needs a new stream)",
                        dir.display()
                    );
                }
            }
        }
        for (i, (s, path)) in steps.iter().enumerate() {
            let (s, path) = (*s, path.as_path());
            // The bucket's newest committed step decides (the publisher's numbering); a saved
            // state of another bucket or an emptied prefix skipped steps the bucket lacks.
            if p.status().last_published.is_some_and(|l| s <= l) {
                continue;
            }
            if twice.contains(&s) {
                // `step_5` and `step_05`, or a directory and a file: which one is step 5 would
                // be a guess (the first in name order was published, the other skipped,
                // silently), so neither is.
                if warned.insert(s) {
                    let names: Vec<String> =
                        steps.iter().filter(|(t, _)| *t == s).map(|(_, q)| q.display().to_string()).collect();
                    eprintln!(
                        "driftless publish: warning: step {s} is named twice ({}): not publishing either",
                        names.join(", ")
                    );
                }
                continue;
            }
            if !complete(path, a.complete_file.as_deref()) {
                // Still being written, or never to be complete (a trainer that crashed while
                // writing it): once a newer step is complete, this one is skipped, with a
                // warning (it waited forever, silently, and so did every newer step).
                let mut newer = steps[i + 1..].iter().filter(|(t, _)| !twice.contains(t));
                match newer.find(|(_, q)| complete(q, a.complete_file.as_deref())) {
                    Some((t, _)) => {
                        eprintln!(
                            "driftless publish: warning: {} (step {s}) is not a complete checkpoint while step {t} is: skipping step {s}",
                            path.display()
                        );
                        continue;
                    }
                    None => {
                        if a.once {
                            eprintln!(
                                "driftless publish: warning: {} (step {s}) is not a complete checkpoint yet: not published",
                                path.display()
                            );
                        }
                        break;
                    }
                }
            }
            if skipped.contains(&s) {
                continue;
            }
            // A signal while idle (or during the scan) starts no new step (found by review: an
            // anchor started after SIGTERM could outlast the grace period).
            if stop::requested().is_some() {
                break;
            }
            // A signal during `publish_one` lets the step finish (publish, upload, marker);
            // it is acted on here, between steps.
            match publish_one(a, p, s, path, published) {
                // Claimed with other weights by a killed predecessor (found by review: every
                // restart stopped at it, and no later step was published): the next step
                // carries newer weights.
                Err(e) if is_taken(&e) => {
                    eprintln!(
                        "driftless publish: warning: {}; skipping step {s}: the next step publishes newer weights",
                        crate::exit::render(&e)
                    );
                    skipped.insert(s);
                    continue;
                }
                // Changing at every read, or removed while read: skipped when a newer entry
                // is complete (it carries newer weights), else read again at the next scan
                // (`--once`: the command fails, exit 2, "retrying may help").
                Err(e) if e.downcast_ref::<Unsettled>().is_some() => {
                    let mut newer = steps[i + 1..].iter().filter(|(t, _)| !twice.contains(t));
                    if let Some((t, _)) = newer.find(|(_, q)| complete(q, a.complete_file.as_deref())) {
                        eprintln!(
                            "driftless publish: warning: {}; skipping step {s}: step {t} publishes newer weights",
                            crate::exit::render(&e)
                        );
                        skipped.insert(s);
                        continue;
                    }
                    if a.once {
                        return Err(e);
                    }
                    eprintln!(
                        "driftless publish: warning: {}; reading {} again at the next scan",
                        crate::exit::render(&e),
                        path.display()
                    );
                    break;
                }
                Err(e) => {
                    *failed = Some(failed.map_or(s, |f| f.max(s)));
                    return Err(e);
                }
                Ok(()) => {}
            }
            *last_done = Some(s);
            if stop::requested().is_some() {
                break;
            }
        }
        if let Some(sig) = stop::requested() {
            p.flush()?;
            // Committed by this publisher or an earlier one (a lost response can hide a commit).
            if let Some(f) = failed.filter(|&f| p.status().last_published.is_none_or(|l| l < f)) {
                eprintln!(
                    "driftless publish: {sig} before step {f} could be published again; stopped with it NOT published"
                );
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Interrupted,
                    format!("stopped by {sig} with step {f} not published (it failed, and the follower was reopening)"),
                )
                .into());
            }
            match last_done {
                Some(s) => eprintln!("driftless publish: {sig}: step {s} was completed and is ready; stopped cleanly"),
                None => eprintln!("driftless publish: {sig}: no step was in flight; stopped cleanly"),
            }
            return Ok(());
        }
        if a.once {
            return Ok(p.flush()?);
        }
        for _ in 0..10 {
            if stop::requested().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whether `e` says the step cannot be published under its number (a later one can).
fn is_taken(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref::<driftless_publisher::Error>(), Some(driftless_publisher::Error::StepTaken { .. }))
}

/// The step number of a `--watch` entry: exactly `{pattern}{N}` (a directory) or
/// `{pattern}{N}.safetensors` (a file). Anything else (`step_5.tmp`, `.step_5`,
/// `step_5.partial`) is not a step yet: trainers write under a temporary name and rename.
fn step_of(name: &str, pattern: &str) -> Option<u64> {
    let rest = name.strip_prefix(pattern)?;
    let num = rest.strip_suffix(".safetensors").unwrap_or(rest);
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    num.parse().ok()
}

/// Whether a `--watch` entry is a complete checkpoint. A file: it parses. A directory: with
/// `--complete-file NAME`, only once NAME exists in it; with an index, once every shard it
/// lists is present; with Hugging Face shard names (`*-00001-of-00004.safetensors`), once
/// all of them are present; and in every case once every shard parses. A directory of
/// other shard names, without an index or completion file, must appear by a rename.
fn complete(path: &Path, complete_file: Option<&str>) -> bool {
    if path.is_dir() {
        if let Some(f) = complete_file {
            if !path.join(f).exists() {
                return false;
            }
        }
        if !path.join(driftless_format::checkpoint::INDEX_FILE).exists() {
            // Every set `{prefix}-{k}-of-{n}` must hold each k of 1..=n, among the names the
            // checkpoint is read from (not hidden: counting names, a hidden partial copy of
            // the last shard made one shard of two pass as complete).
            let mut sets: std::collections::BTreeMap<(String, u64), std::collections::BTreeSet<u64>> =
                Default::default();
            for e in std::fs::read_dir(path).into_iter().flatten().filter_map(|e| e.ok()) {
                let n = e.file_name().to_string_lossy().to_string();
                if let Some((prefix, k, total)) = hf_shard(&n).filter(|_| !n.starts_with('.')) {
                    sets.entry((prefix.to_string(), total)).or_default().insert(k);
                }
            }
            // Numbered 1..=n (Hugging Face), or 0..n by some exporters.
            let whole = |total: u64, ks: &std::collections::BTreeSet<u64>| {
                ks.iter().copied().eq(1..=total) || ks.iter().copied().eq(0..total)
            };
            if sets.iter().any(|((_, total), ks)| !whole(*total, ks)) {
                return false;
            }
        }
    }
    Checkpoint::open(path).is_ok()
}

/// `model-00001-of-00004.safetensors` -> `("model", 1, 4)`.
fn hf_shard(name: &str) -> Option<(&str, u64, u64)> {
    let num = |s: &str| (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten();
    let (rest, total) = name.strip_suffix(".safetensors")?.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    Some((prefix, num(k)?, num(total)?))
}

/// The layout to publish: the checkpoint's own, except that a single-file checkpoint is
/// always published as `model.safetensors`, whatever the input file is called
/// (`step_7.safetensors`), so a renamed input is not a layout change for agents.
fn stable_layout(ck: &Checkpoint, path: &Path) -> driftless_format::Layout {
    let mut l = ck.layout();
    if path.is_file() && l.shards.len() == 1 {
        l.shards[0].file = "model.safetensors".into();
    }
    l
}

/// `--state DIR`: the weights of the newest step this command committed, so that the next
/// run diffs against them instead of publishing an anchor.
///
/// ```text
/// DIR/state.json   {"version": 2, "step": N, "dir": "snap-N"}: written last, atomically
/// DIR/snap-N/      a copy (or hard links) of step N's checkpoint, fsynced before state.json
///                  names it
/// ```
///
/// A crash at any point leaves either the old state or the new one, never a mix; and the
/// publisher checks whichever it finds against the bucket before using it (`seed`), so a
/// linked file that someone rewrote in place costs an anchor, never a wrong delta.
mod state {
    use std::path::{Path, PathBuf};

    use anyhow::{Context, Result};

    #[derive(serde::Serialize, serde::Deserialize)]
    struct StateFile {
        version: u32,
        step: u64,
        dir: String,
    }

    /// The saved step and its checkpoint directory, if a valid state exists.
    pub fn load(dir: &Path) -> Option<(u64, PathBuf)> {
        let b = std::fs::read(dir.join("state.json")).ok()?;
        let s: StateFile = serde_json::from_slice(&b).ok()?;
        let ok = s.version == 2 && s.dir == format!("snap-{}", s.step);
        let p = dir.join(&s.dir);
        (ok && p.is_dir()).then_some((s.step, p))
    }

    /// Copies `ckpt` (a file, or a directory's files, symlinks followed) to `DIR/stage-STEP`
    /// and checks every source unchanged by its copy (length, modification time, inode before
    /// and after, and the bytes), trying three times: the copy is then one state of the
    /// checkpoint, whatever the trainer does to CKPT meanwhile. With `link`, files are hard
    /// links where the filesystem allows (a checkpoint not rewritten in place). Returns the
    /// copy (a directory). `reads`: the reads found changed so far, this step's budget of
    /// three shared with the caller's check after the publisher's read.
    pub fn stage(
        dir: &Path,
        step: u64,
        ckpt: &Path,
        link: bool,
        exclude: &[String],
        reads: &mut u32,
    ) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let stage = dir.join(format!("stage-{step}"));
        let r = stage_into(&stage, step, ckpt, link, exclude, reads);
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&stage);
        }
        r.map(|()| stage)
    }

    /// Length, modification time and inode of a file.
    type Stamp = (u64, i64, i64, u64);

    fn stamp(p: &Path) -> Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
        Ok((m.len(), m.mtime(), m.mtime_nsec(), m.ino()))
    }

    /// The stamps of a staged directory's shards and index, by name. Equal stamps mean
    /// unchanged files but for a write within the clock tick (a few ms) of the first stamp:
    /// a rewrite in place truncates or grows the file too, and most land outside the tick.
    pub fn stamps(dir: &Path, exclude: &[String]) -> Result<Vec<(std::ffi::OsString, Stamp)>> {
        let mut v = vec![];
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let name = e.file_name();
            if super::role(&name.to_string_lossy(), 0, exclude) == Some(true) {
                v.push((name, stamp(&e.path())?));
            }
        }
        v.sort();
        Ok(v)
    }

    fn stage_into(stage: &Path, step: u64, ckpt: &Path, link: bool, exclude: &[String], reads: &mut u32) -> Result<()> {
        // The files to stage: (source, copy, whether it is a shard to check byte for byte).
        let list = || -> Result<Vec<(PathBuf, PathBuf, bool)>> {
            if ckpt.is_file() {
                return Ok(vec![(ckpt.to_path_buf(), stage.join("model.safetensors"), true)]);
            }
            let mut v = vec![];
            for e in std::fs::read_dir(ckpt).with_context(|| format!("reading {}", ckpt.display()))? {
                let e = e?;
                let Ok(m) = std::fs::metadata(e.path()) else { continue };
                let name = e.file_name().to_string_lossy().to_string();
                if let Some(checked) = super::role(&name, m.len(), exclude).filter(|_| m.is_file()) {
                    v.push((e.path(), stage.join(e.file_name()), checked));
                }
            }
            v.sort();
            Ok(v)
        };
        loop {
            let _ = std::fs::remove_dir_all(stage);
            std::fs::create_dir_all(stage)?;
            let files = list()?;
            // Every file stamped before the first copy, and again after the last: each file
            // unchanged by its own copy was not enough (found by review: shard 1 rewritten
            // after its copy, shard 2 before its copy, gave a checkpoint that never existed).
            let before: Vec<Option<(u64, i64, i64, u64)>> =
                files.iter().map(|(src, _, checked)| checked.then(|| stamp(src)).transpose()).collect::<Result<_>>()?;
            let mut changed = None;
            for ((src, dst, checked), before) in files.iter().zip(&before) {
                let symlink = std::fs::symlink_metadata(src).is_ok_and(|m| m.file_type().is_symlink());
                if link && !symlink && std::fs::hard_link(src, dst).is_ok() {
                    continue;
                }
                if !checked {
                    std::fs::copy(src, dst).with_context(|| format!("copying {}", src.display()))?;
                    continue;
                }
                std::fs::copy(src, dst).with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
                // File times move in clock ticks (milliseconds): a write in the tick of the
                // first stamp leaves them as they were. The copy is also compared with the
                // file (one more read, from the page cache).
                if Some(stamp(src)?) != *before || !same_bytes(src, dst)? {
                    changed = Some(src.clone());
                    break;
                }
                #[cfg(test)]
                super::tests::AFTER_COPY.with(|h| (h.borrow_mut().0)(src));
            }
            // (Shards and the index only: files beside the weights are not checked unchanged,
            // as a log the trainer keeps appending to refused every publish.)
            if changed.is_none() {
                let shards = |v: &[(PathBuf, PathBuf, bool)]| -> Vec<PathBuf> {
                    v.iter().filter(|f| f.2).map(|f| f.0.clone()).collect()
                };
                if shards(&list()?) != shards(&files) {
                    changed = Some(ckpt.to_path_buf());
                } else if let Some(((src, _, _), _)) =
                    files.iter().zip(&before).find(|((src, _, checked), b)| *checked && stamp(src).ok() != **b)
                {
                    changed = Some(src.clone());
                }
            }
            let Some(f) = changed else { return Ok(()) };
            *reads += 1;
            super::read_again(&f, step, *reads)?;
        }
    }

    /// Whether two files hold the same bytes (read in 1 MiB blocks).
    fn same_bytes(a: &Path, b: &Path) -> Result<bool> {
        use std::io::Read;
        let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
        if fa.metadata()?.len() != fb.metadata()?.len() {
            return Ok(false);
        }
        let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        loop {
            let n = fa.read(&mut ba)?;
            if n == 0 {
                return Ok(fb.read(&mut bb[..1])? == 0);
            }
            fb.read_exact(&mut bb[..n])?;
            if ba[..n] != bb[..n] {
                return Ok(false);
            }
        }
    }

    /// Copies `ckpt` to `DIR/snap-STEP` (hard links when `link` and the filesystem allows;
    /// fsynced either way), points `state.json` at it (temp file, fsync, rename, fsync of
    /// DIR), then removes older copies.
    pub fn save(dir: &Path, step: u64, ckpt: &Path, link: bool) -> Result<()> {
        let name = format!("snap-{step}");
        let tmp = dir.join(format!("{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let copy = |src: &Path, dst: &Path| -> Result<()> {
            // Another filesystem, or one without links: copy. A symlink is copied (a link of
            // the symlink itself could dangle).
            let symlink = std::fs::symlink_metadata(src).is_ok_and(|m| m.file_type().is_symlink());
            if !link || symlink || std::fs::hard_link(src, dst).is_err() {
                std::fs::copy(src, dst).with_context(|| format!("saving {} to the state directory", src.display()))?;
            }
            std::fs::File::open(dst)?.sync_all()?;
            Ok(())
        };
        if ckpt.is_file() {
            copy(ckpt, &tmp.join("model.safetensors"))?;
        } else {
            for e in std::fs::read_dir(ckpt)? {
                let e = e?;
                // Symlinked shards (a Hugging Face cache) are followed: saved as files.
                if std::fs::metadata(e.path())?.is_file() {
                    copy(&e.path(), &tmp.join(e.file_name()))?;
                }
            }
        }
        sync_dir(&tmp)?;
        let dst = dir.join(&name);
        let _ = std::fs::remove_dir_all(&dst);
        std::fs::rename(&tmp, &dst)?;
        sync_dir(dir)?;
        let st = StateFile { version: 2, step, dir: name.clone() };
        let t = dir.join("state.json.tmp");
        std::fs::write(&t, serde_json::to_vec(&st)?)?;
        std::fs::File::open(&t)?.sync_all()?;
        std::fs::rename(&t, dir.join("state.json"))?;
        sync_dir(dir)?;
        // Older copies (and the layout of earlier versions) are no longer referenced.
        for e in std::fs::read_dir(dir)?.filter_map(|e| e.ok()) {
            let n = e.file_name().to_string_lossy().to_string();
            let numbered =
                |p: &str| n.strip_prefix(p).is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
            if (numbered("snap-") && n != name) || numbered("stage-") || n == "last" || n == "last.step" {
                let p = e.path();
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            }
        }
        Ok(())
    }

    fn sync_dir(d: &Path) -> Result<()> {
        std::fs::File::open(d)?.sync_all()?;
        Ok(())
    }
}

/// SIGINT/SIGTERM for `publish --watch`: the first signal asks to stop after the step in
/// flight (so the stream never holds a half-written step from us); the handler then resets
/// itself, so a second signal kills the process at once (the step in flight is abandoned: it
/// has no ready marker, agents never see it, and the next run publishes an anchor).
mod stop {
    use std::sync::atomic::{AtomicI32, Ordering};

    static SIGNAL: AtomicI32 = AtomicI32::new(0);

    extern "C" fn on_signal(sig: libc::c_int) {
        SIGNAL.store(sig, Ordering::SeqCst);
        let msg: &[u8] = b"driftless publish: stopping after the step in flight (signal again to abandon it)\n";
        // SAFETY: write(2) is async-signal-safe; the buffer is a static string.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
        }
    }

    pub fn install() {
        #[cfg(unix)]
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a plain sigaction with a handler that only touches an atomic and calls
            // write(2); SA_RESETHAND restores the default action after the first delivery.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                sa.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }

    /// The name of the signal received, if any.
    pub fn requested() -> Option<&'static str> {
        match SIGNAL.load(Ordering::SeqCst) {
            0 => None,
            libc::SIGINT => Some("SIGINT"),
            libc::SIGTERM => Some("SIGTERM"),
            _ => Some("signal"),
        }
    }
}

/// Non-weight files of a checkpoint of this size or more are left out (an optimizer state):
/// shipped files are at most [`driftless_format::MAX_EXTRA_FILE`] bytes.
const MAX_EXTRA_FILE: u64 = driftless_format::MAX_EXTRA_FILE;

/// Non-weight files left out whatever their size: what trainers write beside the weights and
/// rewrite at every save, which no inference server reads. Shipped, any one of them would
/// make every step an anchor (a changed extra file must reach every reader). Hugging Face
/// `Trainer` state, DeepSpeed's `latest` tag, logs, locks, and hidden or temporary files (a
/// file still being written under a temporary name).
const DEFAULT_EXCLUDE: &[&str] = &[
    "trainer_state.json",
    "training_args.bin",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "latest",
    "*.log",
    "*.lock",
    "*.tmp",
    ".*",
];

/// Whether a file of a checkpoint directory is one its weights are read from (`Some(true)`:
/// checked unchanged by its copy), one shipped beside them as it is (`Some(false)`: copied),
/// or neither (`None`: left out: an optimizer state, training state, `--exclude`).
fn role(name: &str, len: u64, exclude: &[String]) -> Option<bool> {
    if name.ends_with(".safetensors") || name == driftless_format::checkpoint::INDEX_FILE {
        return Some(true);
    }
    let excluded = DEFAULT_EXCLUDE.iter().copied().chain(exclude.iter().map(String::as_str)).any(|g| glob(g, name));
    (!excluded && len < MAX_EXTRA_FILE).then_some(false)
}

/// Whether `name` matches `pattern` as a whole, `*` matching any run of characters and `?`
/// one character (no character classes: file names only, no paths).
fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic linear backtracking match: on a mismatch, the last `*` takes one more
    // character. O(len(p) x len(n)) at worst; names are short.
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        // A `*` of the pattern is a wildcard even where the name has a `*` (checked first).
        if i < p.len() && p[i] == '*' {
            (star, mark, i) = (Some(i), j, i + 1);
        } else if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            (i, j) = (i + 1, j + 1);
        } else if let Some(s) = star {
            (i, mark) = (s + 1, mark + 1);
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// The non-weight files of a checkpoint directory shipped with its anchors (see [`role`]).
fn extra_files(ckpt: &Path, exclude: &[String]) -> Vec<(String, Vec<u8>)> {
    let Ok(rd) = std::fs::read_dir(ckpt) else { return vec![] };
    let mut listed: Vec<(String, u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            let m = e.metadata().ok()?;
            (m.is_file() && role(&n, m.len(), exclude) == Some(false)).then(|| (n, m.len(), e.path()))
        })
        .collect();
    listed.sort();
    // A file the format cannot carry (an editor's `config.json~`, or past the total) is left
    // out with a warning: found by review, the step was refused and `--watch` stopped there
    // at every restart.
    let mut total = 0u64;
    let mut out = vec![];
    for (name, len, path) in listed {
        let why = if let Err(e) = driftless_format::validate_extra_file_name(&name) {
            e.to_string()
        } else if total + len > driftless_format::MAX_EXTRA_FILES_TOTAL {
            format!("the files beside the weights would pass {} MiB", driftless_format::MAX_EXTRA_FILES_TOTAL >> 20)
        } else if let Ok(b) = std::fs::read(&path) {
            total += len;
            out.push((name, b));
            continue;
        } else {
            continue;
        };
        eprintln!("driftless publish: warning: {}: not shipped beside the weights: {why}", path.display());
    }
    out
}

/// Waits for the uploads; on a terminal (and without --json) shows a progress line on stderr.
fn flush_with_progress(p: &driftless_publisher::Publisher, json: bool) -> Result<()> {
    use std::io::{IsTerminal, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    if json || !std::io::stderr().is_terminal() {
        return Ok(p.wait()?);
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let t = std::time::Instant::now();
            while !done.load(Ordering::Relaxed) {
                let st = p.status();
                eprint!(
                    "\r  uploading: {} queued, {} anchor(s) in flight, {:.1} MiB sent, {:.1} s   ",
                    st.queue_depth,
                    st.anchors_in_flight,
                    st.bytes_uploaded as f64 / 1048576.0,
                    t.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
                std::thread::sleep(Duration::from_millis(200));
            }
            eprint!("\r{:80}\r", "");
        });
        let r = p.wait();
        done.store(true, Ordering::Relaxed);
        r
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// A trainer's write, run after a copy.
    pub(super) struct Hook(pub(super) Box<dyn FnMut(&std::path::Path)>);

    thread_local! {
        /// Called by `state::stage_into` after each shard it copied (a trainer's write).
        pub(super) static AFTER_COPY: std::cell::RefCell<Hook> = std::cell::RefCell::new(Hook(Box::new(|_| {})));
        /// Called by `publish_from` just before the publisher reads the staged checkpoint.
        pub(super) static BEFORE_READ: std::cell::RefCell<Hook> = std::cell::RefCell::new(Hook(Box::new(|_| {})));
        /// Called by `publish_from`'s check, once the publisher has read it.
        pub(super) static IN_CHECK: std::cell::RefCell<Hook> = std::cell::RefCell::new(Hook(Box::new(|_| {})));
    }

    /// Found by review: a `--watch` entry that changed at every read (a trainer slow to finish
    /// its save) or vanished while it was read (its retention) ended the follower (exit 2),
    /// and nothing after it was ever published. Now such an entry is skipped when a newer one
    /// is complete, and otherwise read again later (`--once`: a retryable failure).
    #[test]
    fn a_watch_entry_that_never_settles_does_not_stop_the_follower() {
        for newer in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let (args, bucket, watch) = watch_once(d.path());
            let data = |v: u16| -> Vec<u8> { std::iter::repeat_n(v.to_le_bytes(), 4096).flatten().collect() };
            let save = |dir: &Path, v: u16| {
                let d = data(v);
                let views =
                    [driftless_format::TensorView::new("w", driftless_format::DType::BF16, &[4096], &d).unwrap()];
                let layout = driftless_format::Layout::for_tensors(&[views[0].meta()], u64::MAX).unwrap();
                std::fs::create_dir_all(dir).unwrap();
                driftless_format::checkpoint::write_checkpoint(dir, &layout, &views).unwrap();
            };
            save(&watch.join("step_1"), 1);
            if newer {
                save(&watch.join("step_2"), 2);
            }
            // Step 1's shard is rewritten (in place, new bytes) once each read of it is done.
            let shard = std::fs::read_dir(watch.join("step_1"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .unwrap();
            let checks = std::rc::Rc::new(std::cell::Cell::new(0u16));
            let c2 = checks.clone();
            IN_CHECK.with(|h| {
                *h.borrow_mut() = Hook(Box::new(move |dir| {
                    if dir.ends_with("stage-1") {
                        use std::os::unix::fs::FileExt;
                        c2.set(c2.get() + 1);
                        let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
                        let len = f.metadata().unwrap().len();
                        f.write_all_at(&(100 + c2.get()).to_le_bytes(), len - 2).unwrap();
                    }
                }))
            });
            let mut p = open(&args).unwrap();
            let (mut n, mut done, mut failed) = (0, None, None);
            let r = follow(&args, &watch, &mut p, &mut n, &mut done, &mut failed);
            IN_CHECK.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
            assert_eq!(checks.get(), 3, "newer {newer}: step 1 read three times");
            if newer {
                r.unwrap();
                assert_eq!((done, p.status().last_published), (Some(2), Some(2)));
            } else {
                let e = r.unwrap_err();
                assert!(e.downcast_ref::<Unsettled>().is_some(), "{e:?}");
                assert_eq!(crate::exit::classify(&e), crate::exit::Class::Retryable, "{e:?}");
                assert_eq!(p.status().last_published, None);
            }
            let keys: Vec<String> = walk(&bucket);
            // (`writers/000000000001` is the publisher's lease, generation 1.)
            let step1 = |k: &&String| !k.starts_with("writers/") && k.contains("000000000001");
            assert!(!keys.iter().any(|k| step1(&k)), "newer {newer}: step 1 in the bucket: {keys:?}");
        }
    }

    /// A checkpoint removed while it is staged (the trainer's retention) is `Unsettled`:
    /// retryable, and nothing of it is published (it was a plain I/O error, which ended a
    /// `--watch` follower).
    #[test]
    fn a_checkpoint_removed_while_it_is_read_is_unsettled() {
        let d = tempfile::tempdir().unwrap();
        let (mut args, bucket, _) = watch_once(d.path());
        // `--step`'s staging: copied, so each shard's copy is followed by the hook.
        args.watch = None;
        let ck = d.path().join("ck");
        let data: Vec<u8> = std::iter::repeat_n(7u16.to_le_bytes(), 4096).flatten().collect();
        let views = [
            driftless_format::TensorView::new("a", driftless_format::DType::BF16, &[4096], &data).unwrap(),
            driftless_format::TensorView::new("b", driftless_format::DType::BF16, &[4096], &data).unwrap(),
        ];
        let metas: Vec<_> = views.iter().map(|v| v.meta()).collect();
        let layout = driftless_format::Layout::for_tensors(&metas, 8192).unwrap();
        std::fs::create_dir_all(&ck).unwrap();
        driftless_format::checkpoint::write_checkpoint(&ck, &layout, &views).unwrap();
        let ck2 = ck.clone();
        AFTER_COPY.with(|h| *h.borrow_mut() = Hook(Box::new(move |_| std::fs::remove_dir_all(&ck2).unwrap())));
        let mut p = open(&args).unwrap();
        let r = publish_one(&args, &mut p, 1, &ck, &mut 0);
        AFTER_COPY.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        let e = r.unwrap_err();
        assert!(e.downcast_ref::<Unsettled>().is_some(), "{e:?}");
        assert!(e.to_string().contains("was removed while it was read"), "{e}");
        assert_eq!(crate::exit::classify(&e), crate::exit::Class::Retryable, "{e:?}");
        p.flush().unwrap();
        assert_eq!(p.status().last_published, None);
        assert!(!walk(&bucket).iter().any(|k| k.starts_with("ready/")), "{:?}", walk(&bucket));
    }

    /// The staging and the check after the publisher's read share one budget of three reads
    /// (found by review: three stagings inside each of three reads, up to nine). A `--watch`
    /// entry with a symlinked shard (copied, so checked by the staging) and a plain one (linked,
    /// so checked after the read): the symlink's target is rewritten after every other copy,
    /// the plain shard at every check.
    #[test]
    fn the_staging_and_the_check_share_one_budget_of_reads() {
        let d = tempfile::tempdir().unwrap();
        let (args, bucket, watch) = watch_once(d.path());
        let ck = watch.join("step_1");
        let data: Vec<u8> = std::iter::repeat_n(7u16.to_le_bytes(), 4096).flatten().collect();
        let views = [
            driftless_format::TensorView::new("a", driftless_format::DType::BF16, &[4096], &data).unwrap(),
            driftless_format::TensorView::new("b", driftless_format::DType::BF16, &[4096], &data).unwrap(),
        ];
        let metas: Vec<_> = views.iter().map(|v| v.meta()).collect();
        let layout = driftless_format::Layout::for_tensors(&metas, 8192).unwrap();
        std::fs::create_dir_all(&ck).unwrap();
        driftless_format::checkpoint::write_checkpoint(&ck, &layout, &views).unwrap();
        let (s1, s2) = (ck.join("model-00001-of-00002.safetensors"), ck.join("model-00002-of-00002.safetensors"));
        let target = d.path().join("elsewhere.safetensors");
        std::fs::rename(&s1, &target).unwrap();
        std::os::unix::fs::symlink(&target, &s1).unwrap();
        let rewrite = |p: &Path, v: u8| {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
            f.write_all_at(&[v], f.metadata().unwrap().len() - 1).unwrap();
        };
        let (copies, checks) =
            (std::rc::Rc::new(std::cell::Cell::new(0u8)), std::rc::Rc::new(std::cell::Cell::new(0u8)));
        let (c2, k2, t2, p2) = (copies.clone(), checks.clone(), target.clone(), s2.clone());
        AFTER_COPY.with(|h| {
            *h.borrow_mut() = Hook(Box::new(move |_| {
                c2.set(c2.get() + 1);
                if c2.get() % 2 == 1 {
                    rewrite(&t2, c2.get());
                }
            }))
        });
        IN_CHECK.with(|h| {
            *h.borrow_mut() = Hook(Box::new(move |_| {
                k2.set(k2.get() + 1);
                rewrite(&p2, 100 + k2.get());
            }))
        });
        let mut p = open(&args).unwrap();
        let r = publish_one(&args, &mut p, 1, &ck, &mut 0);
        AFTER_COPY.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        IN_CHECK.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        let e = r.unwrap_err();
        assert!(e.downcast_ref::<Unsettled>().is_some(), "{e:?}");
        // A staging that saw the change, one that did not and whose check did, a staging that
        // saw it: three reads found changed. (Before: six copies and three checks.)
        assert_eq!((copies.get(), checks.get()), (3, 1));
        p.flush().unwrap();
        assert!(!walk(&bucket).iter().any(|k| k.starts_with("ready/")), "{:?}", walk(&bucket));
    }

    /// `publish --watch DIR/watch --once` on `file://DIR/bucket`, state in `DIR/state`:
    /// the arguments, the bucket directory and the watched one.
    fn watch_once(d: &Path) -> (Args, PathBuf, PathBuf) {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let (bucket, watch) = (d.join("bucket"), d.join("watch"));
        std::fs::create_dir_all(&bucket).unwrap();
        let url = format!("file://{}", bucket.display());
        let state = d.join("state");
        let argv: [&std::ffi::OsStr; 8] = [
            "t".as_ref(),
            "--bucket".as_ref(),
            url.as_ref(),
            "--state".as_ref(),
            state.as_os_str(),
            "--watch".as_ref(),
            watch.as_os_str(),
            "--once".as_ref(),
        ];
        (Cli::try_parse_from(argv).unwrap().a, bucket, watch)
    }

    /// Every file under `dir`, relative.
    fn walk(dir: &Path) -> Vec<String> {
        let mut out = vec![];
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    todo.push(p);
                } else {
                    out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
                }
            }
        }
        out
    }

    /// Found by review: a `--watch` entry is read through hard links of the trainer's files,
    /// checked unchanged only while they were linked, so a trainer rewriting it in place
    /// while the publisher read it (shard 2 before the read, shard 1 after) had a step
    /// published that mixed its two saves. The shards are now checked again once the
    /// publisher has its copy: that read is refused, and the step read again whole.
    #[test]
    fn a_watch_entry_rewritten_while_it_is_read_is_read_again() {
        let d = tempfile::tempdir().unwrap();
        let (args, _, watch) = watch_once(d.path());
        // Two shards of one BF16 tensor each; `v` is every element's bit pattern.
        let names = ["a", "b"];
        let shape = [4096u64];
        let bytes = |v: u16| -> Vec<u8> { std::iter::repeat_n(v.to_le_bytes(), 4096).flatten().collect() };
        let save = |dir: &Path, va: u16, vb: u16| {
            let (da, db) = (bytes(va), bytes(vb));
            let views = [
                driftless_format::TensorView::new(names[0], driftless_format::DType::BF16, &shape, &da).unwrap(),
                driftless_format::TensorView::new(names[1], driftless_format::DType::BF16, &shape, &db).unwrap(),
            ];
            let metas: Vec<_> = views.iter().map(|v| v.meta()).collect();
            let layout = driftless_format::Layout::for_tensors(&metas, 8192).unwrap();
            std::fs::create_dir_all(dir).unwrap();
            driftless_format::checkpoint::write_checkpoint(dir, &layout, &views).unwrap();
        };
        let root_of = |dir: &Path| driftless_format::weights_root(&super::super::open(dir).unwrap().views()).1;
        let mut p = open(&args).unwrap();
        let mut n = 0;
        save(&watch.join("step_1"), 1, 2);
        publish_one(&args, &mut p, 1, &watch.join("step_1"), &mut n).unwrap();
        // The trainer's first save of step 2, then its second, in place, while it is read.
        let step2 = watch.join("step_2");
        save(&step2, 3, 4);
        let mut shards: Vec<PathBuf> = std::fs::read_dir(&step2)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                role(&p.file_name().unwrap().to_string_lossy(), 0, &[]) == Some(true)
                    && p.extension().is_some_and(|e| e == "safetensors")
            })
            .collect();
        shards.sort();
        assert_eq!(shards.len(), 2, "{shards:?}");
        let second = d.path().join("second");
        save(&second, 5, 6);
        let (second2, shards2) = (second.clone(), shards.clone());
        let rewrite = move |i: usize| {
            use std::os::unix::fs::FileExt;
            let new = std::fs::read(second2.join(shards2[i].file_name().unwrap())).unwrap();
            std::fs::OpenOptions::new().write(true).open(&shards2[i]).unwrap().write_all_at(&new, 0).unwrap();
        };
        let (reads, checks) = (std::rc::Rc::new(std::cell::Cell::new(0)), std::rc::Rc::new(std::cell::Cell::new(0)));
        let (r2, c2) = (reads.clone(), checks.clone());
        let rewrite2 = rewrite.clone();
        BEFORE_READ.with(|h| {
            *h.borrow_mut() = Hook(Box::new(move |_| {
                r2.set(r2.get() + 1);
                if r2.get() == 1 {
                    rewrite2(1);
                }
            }))
        });
        IN_CHECK.with(|h| {
            *h.borrow_mut() = Hook(Box::new(move |_| {
                c2.set(c2.get() + 1);
                if c2.get() == 1 {
                    rewrite(0);
                }
            }))
        });
        let r = publish_one(&args, &mut p, 2, &step2, &mut n);
        BEFORE_READ.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        IN_CHECK.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        r.unwrap();
        p.flush().unwrap();
        let trust = driftless_format::TrustSet::new().allow_unsigned(true);
        let reader = driftless_store::stream::StreamReader::new(args.bucket.open().unwrap(), trust);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (m, _) = rt.block_on(reader.delta(2)).unwrap();
        assert_eq!(m.result_root, root_of(&second), "step 2 is not the trainer's second save");
        assert_eq!(root_of(&step2), root_of(&second));
        assert_eq!(reads.get(), 2, "the step was read once more");
    }

    /// Found by review: each shard unchanged by its own copy was all that was checked, so a
    /// trainer that rewrote shard 1 after its copy and shard 2 before its copy had a mix of
    /// its two checkpoints staged (and published). Every shard is now stamped before the first
    /// copy and after the last: the first try is refused, the second stages the new checkpoint.
    #[test]
    fn staging_refuses_a_shard_rewritten_after_its_copy() {
        let d = tempfile::tempdir().unwrap();
        let ck = d.path().join("ck");
        std::fs::create_dir_all(&ck).unwrap();
        let (a, b) = (ck.join("model-00001-of-00002.safetensors"), ck.join("model-00002-of-00002.safetensors"));
        std::fs::write(&a, b"old-1").unwrap();
        std::fs::write(&b, b"old-2").unwrap();
        let mut copies = 0;
        let (a2, b2) = (a.clone(), b.clone());
        AFTER_COPY.with(|h| {
            *h.borrow_mut() = Hook(Box::new(move |src| {
                copies += 1;
                // First try: shard 2 saved before its copy, then shard 1 after its own.
                if copies == 1 {
                    assert_eq!(src, a2);
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    std::fs::write(&b2, b"new-2").unwrap();
                }
                if copies == 2 {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    std::fs::write(&a2, b"new-1").unwrap();
                }
            }))
        });
        let staged = super::state::stage(&d.path().join("st"), 1, &ck, false, &[], &mut 0).unwrap();
        AFTER_COPY.with(|h| *h.borrow_mut() = Hook(Box::new(|_| {})));
        let got = |n: &str| std::fs::read(staged.join(n)).unwrap();
        assert_eq!(
            (got("model-00001-of-00002.safetensors"), got("model-00002-of-00002.safetensors")),
            (b"new-1".to_vec(), b"new-2".to_vec()),
            "a mix of two checkpoints was staged"
        );
    }

    use super::*;

    #[test]
    fn glob_matches_whole_names() {
        for (p, n) in
            [("*.log", "train.log"), ("rng_state*.pth", "rng_state_3.pth"), ("?", "a"), ("*", ""), ("a*b*c", "aXbYbc")]
                .into_iter()
                .chain([("*", "*a"), ("a*", "a*b"), ("*.log", "*x.log")])
        {
            assert!(glob(p, n), "{p} {n}");
        }
        for (p, n) in
            [("*.log", "train.log.1"), ("rng_state*.pth", "my_rng_state.pth"), ("?", ""), ("a*b*c", "aXbYbcd")]
        {
            assert!(!glob(p, n), "{p} {n}");
        }
    }

    #[test]
    fn hugging_face_shard_names_are_parsed() {
        assert_eq!(hf_shard("model-00002-of-00004.safetensors"), Some(("model", 2, 4)));
        assert_eq!(hf_shard("a-b-1-of-2.safetensors"), Some(("a-b", 1, 2)));
        for n in
            ["model.safetensors", "model-x-of-00004.safetensors", "model-00001-of-.safetensors", "00001-of-00002.json"]
        {
            assert_eq!(hf_shard(n), None, "{n}");
        }
    }

    #[test]
    fn training_state_and_excluded_files_are_left_out() {
        let ex = vec!["notes*".to_string()];
        assert_eq!(role("model-00001-of-00002.safetensors", 1 << 40, &ex), Some(true));
        assert_eq!(role("model.safetensors.index.json", 10, &ex), Some(true));
        for shipped in ["config.json", "tokenizer.json", "generation_config.json", "tokenizer.model"] {
            assert_eq!(role(shipped, 100, &ex), Some(false), "{shipped}");
        }
        for out in [
            "trainer_state.json",
            "rng_state_1.pth",
            "scheduler.pt",
            "latest",
            "train.log",
            ".config.json.swp",
            "notes.txt",
        ] {
            assert_eq!(role(out, 100, &ex), None, "{out}");
        }
        assert_eq!(role("optimizer_big.bin", MAX_EXTRA_FILE, &ex), None);
    }
}
