/* A switch between emulated hosts' TUN devices with the rate and the delay of real links (benchmarks/netns.py).
 *
 *   delay_switch RATE_BYTES_PER_S DELAY_S QUEUE_S CONTROL_FD FD0 FD1 ...
 *
 * Host i's TUN descriptor is FDi and its address x.x.x.(i + 1). Every IPv4 packet waits for its sender's uplink and
 * its receiver's downlink (RATE each, one packet at a time), then DELAY on the wire; a packet that would wait more
 * than QUEUE for a link is dropped (a switch port's buffer). Runs until killed. Written in C because a switch in
 * Python could not keep up with several 1 Gbit/s flows at once.
 *
 * CONTROL_FD (-1: none) carries lines that cut and mend the way from one host to another, in one direction:
 * "block I J" drops every packet from host I to host J from now on (those on the wire too), "unblock I J" lets
 * them through again. Nothing tells either host: a cut link is silent, as a dead switch port or cable is.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_HOSTS 64
#define MAX_PACKET 65600

struct packet {
    double deliver_at;
    int source;
    size_t size;
    struct packet *next;
    unsigned char data[];
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s RATE DELAY QUEUE CONTROL_FD FD...\n", argv[0]);
        return 2;
    }
    double rate = atof(argv[1]), delay = atof(argv[2]), queue = atof(argv[3]);
    int control = atoi(argv[4]);
    int n = argc - 5;
    if (n > MAX_HOSTS) return 2;
    int fds[MAX_HOSTS];
    double uplink_free[MAX_HOSTS] = {0}, downlink_free[MAX_HOSTS] = {0};
    struct packet *head[MAX_HOSTS] = {0}, *tail[MAX_HOSTS] = {0};
    static unsigned char blocked[MAX_HOSTS][MAX_HOSTS];
    struct pollfd polls[MAX_HOSTS + 1];
    static unsigned char buffer[MAX_PACKET];
    static char commands[4096];
    size_t pending = 0;
    for (int i = 0; i < n; i++) {
        fds[i] = atoi(argv[5 + i]);
        polls[i].fd = fds[i];
        polls[i].events = POLLIN;
    }
    polls[n].fd = control; /* a negative descriptor is ignored by poll */
    polls[n].events = POLLIN;
    for (;;) {
        double t = now();
        double next = t + 0.05;
        /* deliver what is due; each host's queue is in delivery order (its downlink sends one packet at a time) */
        for (int j = 0; j < n; j++) {
            while (head[j] && head[j]->deliver_at <= t) {
                struct packet *p = head[j];
                if (!blocked[p->source][j] && write(fds[j], p->data, p->size) < 0 && errno != EAGAIN) perror("write");
                head[j] = p->next;
                if (!head[j]) tail[j] = NULL;
                free(p);
            }
            if (head[j] && head[j]->deliver_at < next) next = head[j]->deliver_at;
        }
        double wait = next - t > 0 ? next - t : 0;
        struct timespec timeout = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
        int ready = ppoll(polls, n + 1, &timeout, NULL);
        if (ready < 0 && errno != EINTR) {
            perror("poll");
            return 1;
        }
        if (ready <= 0) continue;
        if (polls[n].revents & (POLLIN | POLLHUP)) {
            if (pending >= sizeof commands - 1) pending = 0; /* a line longer than the buffer: dropped */
            ssize_t got = read(control, commands + pending, sizeof commands - 1 - pending);
            if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
                polls[n].fd = -1; /* the controller is gone: the links stay as they are */
            } else if (got > 0) {
                pending += (size_t)got;
                commands[pending] = 0;
                char *line = commands, *end;
                while ((end = strchr(line, '\n')) != NULL) {
                    *end = 0;
                    int from, to;
                    if (sscanf(line, "block %d %d", &from, &to) == 2 && from >= 0 && from < n && to >= 0 && to < n)
                        blocked[from][to] = 1;
                    else if (sscanf(line, "unblock %d %d", &from, &to) == 2 && from >= 0 && from < n && to >= 0 &&
                             to < n)
                        blocked[from][to] = 0;
                    else
                        fprintf(stderr, "delay_switch: unknown command '%s'\n", line);
                    line = end + 1;
                }
                pending = strlen(line);
                memmove(commands, line, pending);
            }
        }
        t = now();
        for (int i = 0; i < n; i++) {
            if (!(polls[i].revents & POLLIN)) continue;
            for (int k = 0; k < 64; k++) {
                ssize_t size = read(fds[i], buffer, sizeof buffer);
                if (size < 0) break; /* EAGAIN: drained */
                if (size < 20 || (buffer[0] >> 4) != 4) continue;
                int j = buffer[19] - 1;
                if (j < 0 || j >= n || j == i || blocked[i][j]) continue;
                double seconds = size / rate;
                double up_done = (t > uplink_free[i] ? t : uplink_free[i]) + seconds;
                double down_start = up_done > downlink_free[j] ? up_done : downlink_free[j];
                if (up_done - t > queue || down_start - up_done > queue) continue; /* dropped */
                uplink_free[i] = up_done;
                downlink_free[j] = down_start + seconds;
                struct packet *p = malloc(sizeof *p + size);
                if (!p) return 1;
                p->deliver_at = down_start + seconds + delay;
                p->source = i;
                p->size = size;
                p->next = NULL;
                memcpy(p->data, buffer, size);
                if (tail[j]) tail[j]->next = p; else head[j] = p;
                tail[j] = p;
            }
        }
    }
}
